"""Host memory per Ray node on one machine (``--node-memory``): each node of a local experiment
cluster in its own memory cgroup, as each host of a real cluster has its own RAM.

A node's raylet starts every process of the node (its workers, so the ranks, the node
monitor and a ``host_memory`` fault's process), so the raylet and its descendants moved into a
cgroup share its limit: the guard reads it there (:mod:`raytrain_guard.runtime.host_memory`
reads the process's own cgroup), and the kernel's OOM killer acts inside it, on that node
only. cgroup v1's memory controller, as root; each cgroup is made under this process's own and
removed when the cluster stops. docs/experiment.md ("Host memory per node").
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from raytrain_guard.errors import InputError

V1_MOUNT = "/sys/fs/cgroup/memory"


def own_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str:
    """This process's cgroup v1 memory path (``/`` at the mount's root)."""
    with open(proc_cgroup) as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return path
    raise OSError("no cgroup v1 memory controller in /proc/self/cgroup")


class NodeCgroups:
    """One memory cgroup of ``limit_bytes`` per node, made by :meth:`confine`. ``mount``: the
    memory controller's mount (tests)."""

    def __init__(self, limit_bytes: int, *, mount: str = V1_MOUNT) -> None:
        self.limit_bytes = int(limit_bytes)
        try:
            self._parent = os.path.join(mount, own_cgroup().lstrip("/"))
            probe = os.path.join(self._parent, f"raytrain_guard_probe_{os.getpid()}")
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as exc:
            raise InputError("--node-memory", f"needs cgroup v1's memory controller, writable "
                             f"(root): {exc}", value=limit_bytes,
                             fix="run it as root on a host with cgroup v1 memory, or leave "
                                 "--node-memory out (every node then reads the machine's RAM)"
                             ) from None
        self.paths: list[str] = []

    def confine(self, index: int, raylet_pid: int) -> str:
        """Node ``index``'s cgroup, with the raylet and its descendants in it; returns its
        path. Confined right after the node starts: the pages its processes held before stay
        charged where they were (newer kernels refuse ``move_charge_at_immigrate``), all
        they and the processes they start allocate after count here."""
        import psutil

        path = os.path.join(self._parent, f"raytrain_guard_{os.getpid()}_node{index}")
        os.makedirs(path, exist_ok=True)
        self.paths.append(path)
        _write(path, "memory.limit_in_bytes", self.limit_bytes)
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            _write(path, "memory.memsw.limit_in_bytes", self.limit_bytes)   # RAM, not swap
        raylet = psutil.Process(raylet_pid)
        for _ in range(10):                 # until no process started meanwhile is left out
            inside = set(pids(path))
            outside = [p.pid for p in [raylet, *raylet.children(recursive=True)]
                       if p.pid not in inside]
            if not outside:
                return path
            for pid in outside:
                try:
                    _write(path, "cgroup.procs", pid)
                except (ProcessLookupError, FileNotFoundError):
                    pass                    # gone meanwhile
        raise RuntimeError(f"node {index}: processes kept starting outside {path}")

    def oom_kills(self) -> list[int]:
        """Per node, the processes the kernel's OOM killer killed in its cgroup so far."""
        return [oom_kills(path) for path in self.paths]

    def close(self) -> None:
        """Remove the cgroups (the cluster has stopped: they are empty)."""
        for path in self.paths:
            try:
                os.rmdir(path)
            except OSError:
                pass                        # a process lives on; the kernel keeps the folder


def pids(path: str) -> Sequence[int]:
    with open(os.path.join(path, "cgroup.procs")) as fh:
        return [int(line) for line in fh if line.strip()]


def oom_kills(path: str) -> int:
    """The ``oom_kill`` count of a cgroup v1 ``memory.oom_control`` (0 where not given)."""
    try:
        with open(os.path.join(path, "memory.oom_control")) as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except OSError:
        pass
    return 0


def _write(path: str, name: str, value: int) -> None:
    with open(os.path.join(path, name), "w") as fh:
        fh.write(str(value))
