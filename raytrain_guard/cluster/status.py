"""``raytrain-guard status``: read the live coordinator's status and print it.

Connects to a running Ray cluster (``--address``, default ``auto``), finds the coordinator actor
by name (``raytrain_guard:coordinator:<run id>``) in the run's namespace, asks for
``Coordinator.status()`` and prints nodes, ranks, memory, step time p50/p99, straggler scores
and active decisions (or the raw dict with ``--json``).

Ray 2.60 turns token authentication on when a cluster has a token; a client must then run with
``RAY_AUTH_MODE=token``. :func:`enable_token_auth_if_token_exists` sets it for the user when a
token exists and the variable is unset.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any, Mapping, MutableMapping

from raytrain_guard.cluster.client import COORDINATOR_PREFIX
from raytrain_guard.errors import InputError

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "raytrain_guard"


class NoCoordinatorError(InputError):
    """No (or more than one) live coordinator matches what the user asked for."""


def enable_token_auth_if_token_exists(environ: MutableMapping[str, str] | None = None,
                                      home: pathlib.Path | None = None) -> bool:
    """Set ``RAY_AUTH_MODE=token`` when a Ray token exists and the variable is unset.

    A token exists when ``RAY_AUTH_TOKEN`` is set, ``RAY_AUTH_TOKEN_PATH`` names a file, or
    ``~/.ray/auth_token`` is a file. Returns True when it set the variable.
    """
    env = os.environ if environ is None else environ
    if env.get("RAY_AUTH_MODE"):
        return False
    home = pathlib.Path.home() if home is None else home
    token_path = env.get("RAY_AUTH_TOKEN_PATH")
    has_token = bool(env.get("RAY_AUTH_TOKEN")) or (
        bool(token_path) and pathlib.Path(token_path).is_file()) or (
        home / ".ray" / "auth_token").is_file()
    if has_token:
        env["RAY_AUTH_MODE"] = "token"
        if environ is None:
            _refresh_ray_auth_config()
    return has_token


def _refresh_ray_auth_config() -> None:
    """Ray reads RAY_AUTH_MODE into a cached config when imported; re-read it if it was."""
    import sys
    if "ray._raylet" not in sys.modules:
        return
    try:
        from ray._raylet import Config   # private; what Ray itself calls after setting the mode
        Config.initialize("")
    except Exception as exc:  # noqa: BLE001 - feature check: older/newer Ray
        logger.debug("could not refresh Ray's auth config: %r", exc)


def choose_coordinator(names: list[str], run_id: str | None, namespace: str) -> str:
    """The coordinator actor name to read, from the named actors of the namespace (pure)."""
    runs = sorted(n for n in names if n.startswith(COORDINATOR_PREFIX))
    if run_id is not None:
        wanted = f"{COORDINATOR_PREFIX}{run_id}"
        if wanted in runs:
            return wanted
        raise NoCoordinatorError("--run-id", f"no coordinator for this run in namespace "
                                 f"{namespace!r}", value=run_id,
                                 fix=_choices(runs) or "start a guarded run first")
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise NoCoordinatorError("--namespace", "no raytrain_guard coordinator is running in "
                                 "this namespace", value=namespace,
                                 fix="start a guarded run, or pass the namespace it runs in")
    raise NoCoordinatorError("--run-id", "several guarded runs are live", value=None,
                             fix=_choices(runs))


def _choices(runs: list[str]) -> str:
    ids = [r[len(COORDINATOR_PREFIX):] for r in runs]
    return f"pass --run-id with one of: {', '.join(ids)}" if ids else ""


def read_status(address: str | None, namespace: str, run_id: str | None = None,
                timeout_s: float = 15.0) -> dict[str, Any]:
    """Connect, find the coordinator, return its ``status()`` (the one function using ray.get)."""
    enable_token_auth_if_token_exists()       # before Ray reads its config
    import ray

    ray.init(address=address or "auto", namespace=namespace, logging_level=logging.WARNING,
             log_to_driver=False, ignore_reinit_error=True)
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == namespace]
        name = choose_coordinator(names, run_id, namespace)
        handle = ray.get_actor(name, namespace=namespace)
        status = ray.get(handle.status.remote(), timeout=timeout_s)
        return {"coordinator": name, **dict(status)}
    finally:
        ray.shutdown()


# -- rendering ---------------------------------------------------------------------------------

def _fmt(x: Any, spec: str = ".3f", unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:{spec}}{unit}"
    return str(x)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):.0f}%"


def _rows(block: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """A mapping ``{key: {...}}`` or a list of dicts, as ``(key, dict)`` rows."""
    if isinstance(block, Mapping):
        return [(str(k), v if isinstance(v, Mapping) else {"value": v}) for k, v in block.items()]
    if isinstance(block, (list, tuple)):
        return [(str(i), v if isinstance(v, Mapping) else {"value": v})
                for i, v in enumerate(block)]
    return []


def format_status(status: Mapping[str, Any]) -> str:
    """A human page of the coordinator's status; unknown keys are listed at the end."""
    lines = [f"coordinator {status.get('coordinator', '?')}"
             + (f"  run {status['run_id']}" if status.get("run_id") else "")
             + (f"  latest step {status['latest_step']}"
                if status.get("latest_step") is not None else "")
             + (f"  step p50 {_fmt(status.get('step_p50_s'))} s p99 "
                f"{_fmt(status.get('step_p99_s'))} s"
                if status.get("step_p50_s") is not None else "")]
    shown = {"coordinator", "run_id", "latest_step", "step_p50_s", "step_p99_s", "nodes", "ranks", "stragglers",
             "straggler_scores", "decisions", "active_decisions"}
    nodes = _rows(status.get("nodes"))
    lines.append(f"\nnodes ({len(nodes)})")
    for key, node in nodes:
        gpus = node.get("gpus") or []
        gpu_txt = " ".join(_pct(g.get("memory_frac")) for g in gpus if isinstance(g, Mapping))
        host = node.get("host") if isinstance(node.get("host"), Mapping) else node
        lines.append(f"  {node.get('node_id', key)[:16]:<16}  host mem "
                     f"{_pct(host.get('memory_used_frac'))}"
                     + (f"  gpu mem {gpu_txt}" if gpu_txt else "")
                     + ("  THROTTLED" if node.get("throttled") else ""))
    ranks = _rows(status.get("ranks"))
    lines.append(f"\nranks ({len(ranks)})")
    lines.append("  rank  node              step   p50 s    p99 s    memory  straggler")
    for key, r in ranks:
        score = r.get("straggler_score")
        if isinstance(score, Mapping):
            score = score.get("score")
        lines.append(f"  {str(r.get('world_rank', key)):>4}  {str(r.get('node_id', '-'))[:16]:<16}"
                     f"  {_fmt(r.get('step'), 'd'):>5}  {_fmt(r.get('step_p50_s')):>7}  "
                     f"{_fmt(r.get('step_p99_s')):>7}  {_pct(r.get('memory_frac')):>6}  "
                     f"{_fmt(score, '.2f')}")
    stragglers = status.get("straggler_scores", status.get("stragglers"))
    if stragglers and not any(isinstance(r, Mapping) and "straggler_score" in r
                              for _, r in ranks):
        lines.append("\nstraggler scores")
        for key, s in _rows(stragglers):
            lines.append(f"  {key}: " + ", ".join(f"{k}={_fmt(v, '.3f')}" for k, v in s.items()))
    decisions = status.get("active_decisions", status.get("decisions")) or []
    lines.append(f"\nactive decisions ({len(decisions)})")
    for d in decisions:
        if isinstance(d, Mapping):
            lines.append(f"  #{d.get('decision_id', '?')} {d.get('action', '?')} at step "
                         f"{d.get('step', '-')} [{d.get('scope', '-')}]: {d.get('reason', '')}")
        else:
            lines.append(f"  {d}")
    rest = {k: v for k, v in status.items() if k not in shown}
    if rest:
        lines.append("")
        for k, v in rest.items():
            lines.append(f"{k}: {v}")
    return "\n".join(lines)
