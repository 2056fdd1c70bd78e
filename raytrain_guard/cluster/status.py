"""``raytrain-guard status``: read the live coordinator's status and print it.

Connects to a running Ray cluster (``--address``, default ``auto``), finds the run's coordinator
by name and prints its ``status()``. An explicit ``--address`` is checked first
(:func:`check_reachable`), so a wrong one fails in a second with one line; past that,
:data:`GCS_CONNECT_ENV` bounds Ray's own connection attempt.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pathlib
import socket
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

from raytrain_guard.coordination.link import COORDINATOR_PREFIX, coordinator_name
from raytrain_guard.errors import InputError

logger = logging.getLogger(__name__)

#: Ray's GCS connection knobs while ``status`` connects (a value the user set wins): Ray's
#: defaults retry an address that is not a Ray cluster for over ten minutes; these, about 12 s.
GCS_CONNECT_ENV = {
    "RAY_gcs_rpc_server_connect_timeout_s": "4",   # one connect attempt (Ray's default 5)
    "RAY_py_gcs_connect_timeout_s": "4",           # wait for the cluster id (Ray's default 30)
    "RAY_gcs_server_port_wait_time_s": "1",        # attempts of ray.init's loop (default 20)
}

#: how long :func:`check_reachable` waits for a TCP connection to ``--address``
PROBE_TIMEOUT_S = 3.0

_ADDRESS_FIX = ("start the cluster (ray start --head) or pass the address it printed, "
                "host:port of the head (port 6379 by default)")


class NoCoordinatorError(InputError):
    """No (or more than one) live coordinator matches what the user asked for."""


class ClusterUnreachableError(InputError):
    """``--address`` names no reachable Ray cluster (the CLI exits 2 with one line)."""


def split_address(address: str | None) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``ray://host:port``; None for
    ``auto``/``local``/none. An ``http(s)://`` address (the dashboard's) is refused."""
    if address is None or address.strip() in ("", "auto", "local"):
        return None
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme.lower() in ("http", "https"):
            raise ClusterUnreachableError(
                "--address", "an http address is the dashboard's (for ray job submit), not the "
                "cluster's", value=address, fix="pass the head's host:port (port 6379 by "
                "default), e.g. --address 10.0.0.1:6379")
        if scheme.lower() != "ray":
            raise ClusterUnreachableError("--address", f"unknown scheme {scheme}://",
                                          value=address, fix="pass host:port, e.g. "
                                          "--address 10.0.0.1:6379")
        text = rest
    text = text.rstrip("/")
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterUnreachableError("--address", "needs host:port", value=address,
                                      fix="pass e.g. --address 10.0.0.1:6379, or leave it out "
                                      "to find a cluster started on this machine")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reachable(address: str | None, *, timeout_s: float = PROBE_TIMEOUT_S,
                    connect: Callable[..., Any] = socket.create_connection,
                    local_ip: Callable[[], str] | None = None) -> None:
    """Raise :class:`ClusterUnreachableError` unless the host of ``address`` resolves and a TCP
    connection to its port opens within ``timeout_s``. For a loopback host this machine's node
    IP (``local_ip()``) counts too: Ray connects to that."""
    parsed = split_address(address)
    if parsed is None:
        return
    host, port = parsed
    hosts = [host]
    if _is_loopback(host):
        with contextlib.suppress(Exception):   # best effort: the loopback probe still counts
            hosts.append((local_ip or _node_ip)())
    reasons = []
    for candidate in hosts:
        try:
            with connect((candidate, port), timeout=timeout_s):
                return
        except socket.gaierror:
            raise ClusterUnreachableError("--address", f"unknown host {host!r}", value=address,
                                          fix=_ADDRESS_FIX) from None
        except TimeoutError:
            reasons.append(f"no answer within {timeout_s:g} s")
        except OSError as exc:
            reasons.append(exc.strerror or type(exc).__name__)
    raise ClusterUnreachableError(
        "--address", f"nothing listens on that port ({reasons[0].lower()})",
        value=address, fix=_ADDRESS_FIX)


def _node_ip() -> str:
    import ray.util
    return ray.util.get_node_ip_address()


@contextlib.contextmanager
def _gcs_connect_env(environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """:data:`GCS_CONNECT_ENV` in the environment (values already set win), restored after."""
    env = os.environ if environ is None else environ
    added = [k for k in GCS_CONNECT_ENV if k not in env]
    for k in added:
        env[k] = GCS_CONNECT_ENV[k]
    if added and environ is None:
        _refresh_ray_config()        # Ray re-reads its config (if it was imported)
    try:
        yield
    finally:
        for k in added:
            env.pop(k, None)


def enable_token_auth_if_token_exists(environ: MutableMapping[str, str] | None = None,
                                      home: pathlib.Path | None = None) -> bool:
    """Set ``RAY_AUTH_MODE=token`` (which Ray's client needs against a cluster with a token)
    when the variable is unset and a token exists: ``RAY_AUTH_TOKEN``, the file
    ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``. Returns True when it set it."""
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
            _refresh_ray_config()
    return has_token


def _refresh_ray_config() -> None:
    """Make an already imported Ray re-read its ``RAY_*`` variables, through the private
    ``ray._raylet.Config.initialize`` (what Ray itself calls); a warning where that fails."""
    import sys
    if "ray._raylet" not in sys.modules:
        return
    try:
        from ray._raylet import Config
        Config.initialize("")
    except Exception as exc:  # noqa: BLE001 - feature check: older/newer Ray
        logger.warning("could not make the imported Ray read RAY_AUTH_MODE=token (%r): if the "
                       "cluster refuses the connection, set RAY_AUTH_MODE=token before "
                       "running", exc)


def choose_coordinator(names: list[str], run_id: str | None, namespace: str) -> str:
    """The coordinator actor name to read, from the named actors of the namespace (pure)."""
    runs = sorted(n for n in names if n.startswith(COORDINATOR_PREFIX))
    if run_id is not None:
        wanted = coordinator_name(run_id)
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
    """Connect, find the coordinator, return its ``status()`` (the one function using ray.get);
    :class:`ClusterUnreachableError` when no cluster answers."""
    enable_token_auth_if_token_exists()       # before Ray reads its config
    check_reachable(address)
    import ray

    try:
        with _gcs_connect_env():
            ray.init(address=address or "auto", namespace=namespace,
                     logging_level=logging.WARNING, log_to_driver=False,
                     ignore_reinit_error=True)
    except ConnectionError as exc:
        raise ClusterUnreachableError(
            "--address", f"cannot connect: {str(exc).rstrip('.')}", value=address,
            fix=_ADDRESS_FIX if address else "start a cluster (ray start --head), or pass "
            "--address host:port of a running one") from None
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

def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):.0f}%"


def format_status(status: Mapping[str, Any]) -> str:
    """A human page of the coordinator's status (``--json`` has the debug counters too)."""
    lines = [f"coordinator {status.get('coordinator', '?')}"
             + (f"  run {status['run_id']}" if status.get("run_id") else "")
             + (f"  latest step {status['latest_step']}"
                if status.get("latest_step") is not None else "")
             + (f"  step p50 {_fmt(status.get('step_p50_s'))} s p99 "
                f"{_fmt(status.get('step_p99_s'))} s"
                if status.get("step_p50_s") is not None else "")]
    nodes = status.get("nodes") or {}
    lines.append(f"\nnodes ({len(nodes)})")
    for key, node in nodes.items():
        gpu_txt = " ".join(_pct(g.get("memory_frac")) for g in node.get("gpus") or ())
        lines.append(f"  {key[:16]:<16}  host mem "
                     f"{_pct((node.get('host') or {}).get('memory_used_frac'))}"
                     + (f"  gpu mem {gpu_txt}" if gpu_txt else "")
                     + ("  THROTTLED" if node.get("throttled") else ""))
    ranks = status.get("ranks") or {}
    lines.append(f"\nranks ({len(ranks)})")
    lines.append("  rank  node              step   p50 s    p99 s    memory  straggler")
    for key, r in ranks.items():
        lines.append(f"  {key!s:>4}  {str(r.get('node_id', '-'))[:16]:<16}"
                     f"  {_fmt(r.get('step'), 'd'):>5}  {_fmt(r.get('step_p50_s')):>7}  "
                     f"{_fmt(r.get('step_p99_s')):>7}  {_pct(r.get('memory_frac')):>6}  "
                     f"{_fmt(r.get('straggler_score'), '.2f')}")
    decisions = status.get("active_decisions") or []
    lines.append(f"\nactive decisions ({len(decisions)})")
    lines += [f"  #{d.get('decision_id', '?')} {d.get('action', '?')} at step "
              f"{d.get('step', '-')} [{d.get('scope', '-')}]: {d.get('reason', '')}"
              for d in decisions]
    return "\n".join(lines + _user_notes(status))


#: what each ignored-report counter means to a reader of the status page
_IGNORED_MEANING = {"stale": "from an earlier attempt of the run",
                    "duplicate": "a batch already received",
                    "out_of_order": "steps already received from that rank",
                    "malformed": "unreadable"}


def _user_notes(status: Mapping[str, Any]) -> list[str]:
    """The rest of the status that a user acts on, in words."""
    lines = []
    attempt = status.get("attempt")
    if isinstance(attempt, int) and attempt > 1:
        lines.append(f"attempt {attempt}: the worker group restarted {attempt - 1} time(s)")
    lines += [f"hang in attempt {h.get('attempt', '?')}: {h.get('reason', '')}"
              for h in status.get("hangs") or ()]
    if status.get("straggler_nodes"):
        lines.append("straggler nodes: " + ", ".join(str(n) for n in status["straggler_nodes"]))
    lines += [f"note: {note}" for note in status.get("notes") or ()]
    ignored = status.get("ignored") or {}
    if any(ignored.values()):
        lines.append("ignored reports: " + ", ".join(
            f"{n} {k.replace('_', ' ')} ({_IGNORED_MEANING.get(k, k)})"
            for k, n in ignored.items() if n))
    return [""] + lines if lines else []
