"""Fault specs of the before/after experiment: what to inject, on which ranks, when (pure).

A spec is written ``KIND:key=value,...`` (``slow_compute:rank=1,start=25,factor=2.5``). Every
kind takes ``rank`` (or ``ranks=0+1``), ``start`` (the step it begins at) and an optional
``stop`` (the first step without it). ``slow_compute``, ``comm_delay`` and ``host_memory`` take
``node=K`` instead of ranks: every rank placed on the experiment's node K (0..nodes-1, in the
order the driver started them), known only once the ranks run. What each kind rehearses and
where it is injected:
docs/experiment.md ("Faults"). ``crash`` and ``hang`` are transient, as a lost node or a wedged
driver is: they fire once per run, so a restarted group trains on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_guard.errors import InputError, check_int
from raytrain_guard.units import parse_bytes


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault: its own keys (name -> (parser, default; None: required)), an example
    spec, the cause a guard should name (None: no slow-step cause, e.g. memory), and whether it
    fires once per run. ``felt_by_all``: every rank waits on it in the step's collective (a slow
    link), so any rank may name it, by its cause."""

    keys: Mapping[str, tuple[Any, Any]]
    example: str
    cause: str | None = None
    once: bool = False
    by_node: bool = False       # takes ``node=K``: every rank of node K
    felt_by_all: bool = False


def _above(bound: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not value > bound:
            raise ValueError(f"must be > {bound:g}")
        return value
    return parse


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise ValueError("must be between 0 and 1")
    return value


def _positive_int(text: str) -> int:
    return check_int("value", text, at_least=1, parse=True)   # parse_fault names the key


KINDS: Mapping[str, FaultKind] = {
    "comm_delay": FaultKind({"seconds": (_above(0), None)},
                            "comm_delay:rank=1,start=20,seconds=0.02", "communication",
                            by_node=True, felt_by_all=True),
    "slow_compute": FaultKind({"factor": (_above(1), None)},
                              "slow_compute:rank=1,start=25,factor=2.5", "compute", by_node=True),
    "slow_data": FaultKind({"seconds": (_above(0), None)},
                           "slow_data:rank=1,start=20,seconds=0.01", "data"),
    "memory_growth": FaultKind({"per_step": (parse_bytes, None)},
                               "memory_growth:rank=1,start=10,per_step=1MiB"),
    "activation_spike": FaultKind({"factor": (_positive_int, None), "steps": (_positive_int, 1)},
                                  "activation_spike:rank=1,start=30,factor=8,steps=3"),
    "host_memory": FaultKind({"size": (parse_bytes, 0), "frac": (_fraction, 0.0),
                              "per_step": (parse_bytes, 0)},
                             "host_memory:rank=0,start=10,size=2GiB", by_node=True),
    "crash": FaultKind({}, "crash:rank=1,start=40", once=True),
    "hang": FaultKind({}, "hang:rank=1,start=40", once=True),
}

_COMMON = ("rank", "ranks", "node", "start", "stop")


@dataclass(frozen=True)
class FaultSpec:
    """One fault: ``kind`` on ``ranks`` from step ``start`` up to ``stop`` (None: to the end).
    ``node``: the experiment's node whose every rank it is on (``ranks`` empty until
    :meth:`on_ranks` names them)."""

    kind: str
    ranks: tuple[int, ...]
    start: int
    stop: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    node: int | None = None

    def active(self, step: int) -> bool:
        return step >= self.start and (self.stop is None or step < self.stop)

    @property
    def last_step(self) -> int | None:
        """The last step it is active at: ``stop - 1``; ``start + steps - 1`` for a spike
        (``steps`` steps); ``start`` for a fault that fires once (crash, hang); None: to the
        end."""
        if self.stop is not None:
            return self.stop - 1
        if "steps" in self.params:
            return self.start + int(self.params["steps"]) - 1
        return self.start if self.once else None

    def on(self, rank: int, node_index: int | None = None) -> bool:
        """Whether it is on ``rank``, placed on the experiment's node ``node_index``."""
        return rank in self.ranks or (self.node is not None and self.node == node_index)

    def on_ranks(self, ranks: Iterable[int]) -> FaultSpec:
        """A node fault with the ranks its node held named (for the analysis)."""
        return dataclasses.replace(self, ranks=tuple(sorted(set(ranks))))

    @property
    def once(self) -> bool:
        return KINDS[self.kind].once

    @property
    def felt_by_all(self) -> bool:
        return KINDS[self.kind].felt_by_all

    @property
    def cause(self) -> str | None:
        """The cause a guard should name for this fault (``compute``, ``data``, ...)."""
        return KINDS[self.kind].cause

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "start": self.start,
                "stop": self.stop, "params": dict(self.params), "node": self.node}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FaultSpec:
        return cls(str(d["kind"]), tuple(int(r) for r in d["ranks"]), int(d["start"]),
                   None if d.get("stop") is None else int(d["stop"]), dict(d.get("params", {})),
                   None if d.get("node") is None else int(d["node"]))

    def __str__(self) -> str:
        where = f"node={self.node}" if self.node is not None else \
            f"ranks={'+'.join(map(str, self.ranks))}"
        keys = [where, f"start={self.start}"]
        if self.stop is not None:
            keys.append(f"stop={self.stop}")
        defaults = {k: default for k, (_, default) in KINDS[self.kind].keys.items()}
        keys += [f"{k}={v}" for k, v in self.params.items()
                 if defaults.get(k) is None or v != defaults[k]]     # optional keys left out
        return f"{self.kind}:{','.join(keys)}"


def parse_fault(text: str, *, world_size: int | None = None,
                num_nodes: int | None = None) -> FaultSpec:
    """``KIND:key=value,...`` -> :class:`FaultSpec`; InputError naming the kind or key and the
    fix. ``world_size``: when given, every rank must be below it; ``num_nodes``: every node."""
    flag = "--fault"
    kind, _, rest = str(text).strip().partition(":")
    if kind not in KINDS:
        raise InputError(flag, f"unknown fault kind {kind!r}", value=text,
                         fix="use one of " + ", ".join(KINDS))
    spec = KINDS[kind]
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise InputError(flag, f"{kind}: {item!r} is not key=value", value=text,
                             fix=f"write e.g. {kind}:rank=1,start=20")
        if key not in spec.keys and key not in _COMMON:
            raise InputError(flag, f"{kind}: unknown key {key!r}", value=text,
                             fix="keys: " + ", ".join((*(k for k in _COMMON[1:]
                                                          if k != "node" or spec.by_node),
                                                        *spec.keys)))
        values[key] = value
    if "rank" in values and "ranks" in values:
        raise InputError(flag, f"{kind}: both rank and ranks", value=text,
                         fix="give one rank (rank=1) or several (ranks=0+1)")
    if "node" in values:
        return _parse_node_fault(kind, values, text, num_nodes)
    try:
        ranks = tuple(int(r) for r in values.get("ranks", values.get("rank", "")).split("+"))
    except ValueError:
        raise InputError(flag, f"{kind}: rank must be a whole number (ranks: joined by +)",
                         value=text, fix=f"write e.g. {kind}:rank=1 or {kind}:ranks=0+1") from None
    if any(r < 0 or (world_size is not None and r >= world_size) for r in ranks):
        raise InputError(flag, f"{kind}: rank out of range", value=text,
                         fix=f"use ranks 0..{(world_size or 1) - 1}")
    if "start" not in values:
        raise InputError(flag, f"{kind}: missing start", value=text,
                         fix=f"add start=STEP, e.g. {spec.example}")
    start, stop, params = _window_and_params(kind, values, text)
    return FaultSpec(kind, ranks, start, stop, params)


def _parse_node_fault(kind: str, values: Mapping[str, str], text: str,
                      num_nodes: int | None) -> FaultSpec:
    """``node=K``: every rank of the experiment's node K; never with rank or ranks."""
    flag, spec = "--fault", KINDS[kind]
    if not spec.by_node:
        takes = ", ".join(k for k, s in KINDS.items() if s.by_node)
        raise InputError(flag, f"{kind}: takes no node key (node= is for {takes})", value=text,
                         fix=f"name its ranks instead, e.g. {spec.example}")
    if "rank" in values or "ranks" in values:
        raise InputError(flag, f"{kind}: node and rank(s) together", value=text,
                         fix=f"give node=K for every rank of node K, or rank=/ranks= for "
                             f"chosen ranks, not both (e.g. {kind}:node=1,...)")
    node = _parse_key(kind, "node", values["node"], _step, text)
    if num_nodes is not None and node >= num_nodes:
        raise InputError(flag, f"{kind}: node {node} is not below --nodes {num_nodes}",
                         value=text, fix=f"use node 0..{num_nodes - 1}, or pass --nodes "
                                         f"{node + 1}")
    if "start" not in values:
        raise InputError(flag, f"{kind}: missing start", value=text,
                         fix=f"add start=STEP, e.g. {kind}:node={node},start=20")
    start, stop, params = _window_and_params(kind, values, text)
    return FaultSpec(kind, (), start, stop, params, node=node)


def _window_and_params(kind: str, values: Mapping[str, str], text: str
                       ) -> tuple[int, int | None, dict[str, Any]]:
    """``start``, ``stop`` and the kind's own keys of a spec's ``values``."""
    flag, spec = "--fault", KINDS[kind]
    start = _parse_key(kind, "start", values["start"], _step, text)
    stop = _parse_key(kind, "stop", values["stop"], _step, text) if "stop" in values else None
    if stop is not None and stop <= start:
        raise InputError(flag, f"{kind}: stop must be after start", value=text,
                         fix=f"use stop > {start}, or leave it out (to the end)")
    params: dict[str, Any] = {}
    for key, (parse, default) in spec.keys.items():
        if key not in values:
            if default is None:
                raise InputError(flag, f"{kind}: missing {key}", value=text,
                                 fix=f"add {key}=..., e.g. {spec.example}")
            params[key] = default
            continue
        params[key] = _parse_key(kind, key, values[key], parse, text)
    if kind == "host_memory" and not any(params.values()):
        raise InputError(flag, f"{kind}: holds nothing", value=text,
                         fix="give size=BYTES, frac=F (fill the host to F of its RAM) or "
                             f"per_step=BYTES, e.g. {spec.example}")
    return start, stop, params


def _step(text: str) -> int:
    return check_int("step", text, parse=True)


def _parse_key(kind: str, key: str, value: str, parse: Any, text: str) -> Any:
    """``parse(value)``, or an InputError on ``--fault`` naming the kind, the key and why."""
    try:
        return parse(value)
    except InputError as exc:    # check_int's or parse_bytes' wording, under this key
        why = exc.problem
    except ValueError as exc:
        why = str(exc)
    raise InputError("--fault", f"{kind}: {key}={value} is not valid ({why})", value=text,
                     fix=f"e.g. {KINDS[kind].example}")
