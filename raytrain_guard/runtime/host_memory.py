"""Host memory as this process may use it (psutil, narrowed to the container's cgroup limit).

The one place that reads host RAM: the DataLoader sizing, the CPU memory probe, the node
monitor and the CLI's machine defaults all call it, so on Ray-on-Kubernetes every part of the
guard sees the container's limit rather than the machine's RAM.
"""

from __future__ import annotations

import os


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM, narrowed to the cgroup limit.

    In a container psutil reports the machine's RAM; the memory this process may use is the
    tightest cgroup limit over it (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) minus its
    working set (:func:`read_cgroup_memory`).
    """
    import psutil

    vm = psutil.virtual_memory()
    return within_cgroup(int(vm.total), int(vm.available), *read_cgroup_memory())


def within_cgroup(total: int, available: int, limit: int | None,
                  usage: int | None) -> tuple[int, int]:
    """(total, available) of the host, narrowed to a cgroup ``limit`` with ``usage`` in it."""
    if limit is None or limit <= 0 or limit >= total:
        return total, available
    free_in_cgroup = max(0, limit - (usage or 0))
    return limit, min(available, free_in_cgroup)


#: where each cgroup version mounts the memory controller: (version, mount, its files'
#: names for the limit, the usage and the reclaimable page cache in memory.stat)
CGROUP_MOUNTS = (("v2", "sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
                 ("v1", "sys/fs/cgroup/memory", "memory.limit_in_bytes",
                  "memory.usage_in_bytes", "total_inactive_file"))
#: a limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page)
UNLIMITED = 1 << 60


def read_cgroup_memory(root: str = "/") -> tuple[int | None, int | None]:
    """(limit, usage) of the tightest memory cgroup over this process, or (None, None) when
    none is limited or none can be read.

    The process's own cgroup (``/proc/self/cgroup``) and every one above it to the mount's
    root count: a Slurm job, a systemd slice or a Kubernetes pod limits a cgroup above the one
    a process runs in, and a host without cgroup namespaces shows the machine's root at the
    mount point. The tightest is the one with the least room (limit less usage). Usage is the
    working set, as the kubelet counts it: less the inactive page cache, which the kernel
    reclaims before it kills. ``root``: the filesystem root (tests)."""
    best: tuple[int, int] | None = None
    for version, mount, limit_name, usage_name, cache_key in CGROUP_MOUNTS:
        base = os.path.join(root, mount)
        for folder in _own_and_above(root, base, version):
            try:
                with open(os.path.join(folder, limit_name)) as fh:
                    text = fh.read().strip()
                if text == "max" or int(text) >= UNLIMITED:
                    continue
                with open(os.path.join(folder, usage_name)) as fh:
                    usage = int(fh.read().strip())
            except (OSError, ValueError):
                continue
            limit = int(text)
            usage = max(0, usage - _stat(os.path.join(folder, "memory.stat"), cache_key))
            if best is None or limit - usage < best[0] - best[1]:
                best = (limit, usage)
        if best is not None:
            return best
    return None, None


def _own_and_above(root: str, base: str, version: str) -> list[str]:
    """The folders of this process's cgroup under ``base`` and of each cgroup above it, the
    mount's root last (the root alone when ``/proc/self/cgroup`` does not say)."""
    path = ""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as fh:
            for line in fh:
                _, controllers, cgroup = line.rstrip("\n").split(":", 2)
                if (version == "v2" and controllers == "") or (
                        version == "v1" and "memory" in controllers.split(",")):
                    path = cgroup.strip("/")
                    break
    except (OSError, ValueError):
        pass
    parts = [p for p in path.split("/") if p]
    return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]


def _stat(path: str, key: str) -> int:
    """``key``'s value in a ``memory.stat`` file (0 when absent)."""
    try:
        with open(path) as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def private_bytes(pid: int) -> int | None:
    """Private (unique set) memory of one process, or None when it is gone or unreadable."""
    import psutil

    try:
        return int(psutil.Process(pid).memory_full_info().uss)
    except (psutil.Error, OSError):
        return None
