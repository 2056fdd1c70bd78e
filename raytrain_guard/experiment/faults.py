"""Fault specs of the before/after experiment: what to inject, on which ranks, when (pure).

A spec is written ``KIND:key=value,...`` (``slow_compute:rank=1,start=25,factor=2.5``). Every
kind takes ``rank`` (or ``ranks=0+1``), ``start`` (the step it begins at) and an optional
``stop`` (the first step without it). :data:`KINDS` lists each kind's own keys, what it
rehearses and the cause a guard should name for it. ``crash`` and ``hang`` are transient, as a
lost node or a wedged driver is: they happen once per run, on the first attempt that reaches
``start``, so a restarted group trains on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_guard.errors import InputError, check_int
from raytrain_guard.units import parse_bytes


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault: its own keys (name -> (parser, default; None: required)), what it
    rehearses, and the cause a guard should name (None: no slow-step cause, e.g. memory)."""

    keys: Mapping[str, tuple[Any, Any]]
    rehearses: str
    cause: str | None = None
    once: bool = False


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def _factor(text: str) -> float:
    value = float(text)
    if not value > 1:
        raise ValueError("must be > 1")
    return value


def _size(text: str) -> int:
    return parse_bytes(text)


def _positive_int(text: str) -> int:
    return check_int("value", text, at_least=1, parse=True)   # parse_fault names the key


KINDS: Mapping[str, FaultKind] = {
    "comm_delay": FaultKind({"seconds": (_positive_float, None)},
                            "a slow or congested link: the rank's gradient communication waits "
                            "`seconds` per step (DDP's communication hook; FSDP2's first timed "
                            "reduce-scatter: every unit's on gloo, the root's on CUDA)",
                            "communication"),
    "slow_compute": FaultKind({"factor": (_factor, None)},
                              "a down-clocked GPU: the rank's forward and backward take `factor` "
                              "times as long", "compute"),
    "slow_data": FaultKind({"seconds": (_positive_float, None)},
                           "slow storage: each sample of the rank's dataset takes `seconds` to "
                           "read, in its DataLoader workers", "data"),
    "memory_growth": FaultKind({"per_step": (_size, None)},
                               "a leak: the rank holds `per_step` more device memory every step"),
    "activation_spike": FaultKind({"factor": (_positive_int, None), "steps": (_positive_int, 1)},
                                  "a stretch of long documents: `steps` steps whose batches are "
                                  "`factor` times longer, so activations grow with them"),
    "host_memory": FaultKind({"size": (_size, None)},
                             "another process on the rank's node holds `size` of host RAM"),
    "crash": FaultKind({}, "the rank's process dies at `start` (once per run)", once=True),
    "hang": FaultKind({}, "the rank blocks forever in its step from `start` (once per run)",
                      once=True),
}

_COMMON = ("rank", "ranks", "start", "stop")


@dataclass(frozen=True)
class FaultSpec:
    """One fault: ``kind`` on ``ranks`` from step ``start`` up to ``stop`` (None: to the end)."""

    kind: str
    ranks: tuple[int, ...]
    start: int
    stop: int | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def active(self, step: int) -> bool:
        return step >= self.start and (self.stop is None or step < self.stop)

    def on(self, rank: int) -> bool:
        return rank in self.ranks

    @property
    def once(self) -> bool:
        return KINDS[self.kind].once

    @property
    def cause(self) -> str | None:
        """The cause a guard should name for this fault (``compute``, ``data``, ...)."""
        return KINDS[self.kind].cause

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "start": self.start,
                "stop": self.stop, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FaultSpec:
        return cls(str(d["kind"]), tuple(int(r) for r in d["ranks"]), int(d["start"]),
                   None if d.get("stop") is None else int(d["stop"]), dict(d.get("params", {})))

    def __str__(self) -> str:
        keys = [f"ranks={'+'.join(map(str, self.ranks))}", f"start={self.start}"]
        if self.stop is not None:
            keys.append(f"stop={self.stop}")
        keys += [f"{k}={v}" for k, v in self.params.items()]
        return f"{self.kind}:{','.join(keys)}"


def parse_fault(text: str, *, world_size: int | None = None) -> FaultSpec:
    """``KIND:key=value,...`` -> :class:`FaultSpec`; InputError naming the kind or key and the
    fix. ``world_size``: when given, every rank must be below it."""
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
                             fix="keys: " + ", ".join((*_COMMON[1:], *spec.keys)))
        values[key] = value
    if "rank" in values and "ranks" in values:
        raise InputError(flag, f"{kind}: both rank and ranks", value=text,
                         fix="give one rank (rank=1) or several (ranks=0+1)")
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
                         fix=f"add start=STEP, e.g. {_EXAMPLES[kind]}")
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
                                 fix=f"add {key}=..., e.g. {_EXAMPLES[kind]}")
            params[key] = default
            continue
        params[key] = _parse_key(kind, key, values[key], parse, text)
    return FaultSpec(kind, ranks, start, stop, params)


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
                     fix=f"e.g. {_EXAMPLES[kind]}")


_EXAMPLES = {
    "comm_delay": "comm_delay:rank=1,start=20,seconds=0.02",
    "slow_compute": "slow_compute:rank=1,start=25,factor=2.5",
    "slow_data": "slow_data:rank=1,start=20,seconds=0.01",
    "memory_growth": "memory_growth:rank=1,start=10,per_step=1MiB",
    "activation_spike": "activation_spike:rank=1,start=30,factor=8,steps=3",
    "host_memory": "host_memory:rank=0,start=10,size=2GiB",
    "crash": "crash:rank=1,start=40",
    "hang": "hang:rank=1,start=40",
}
