"""Host memory as this process may use it (psutil, narrowed to the container's cgroup limit).

The one place that reads host RAM: the DataLoader sizing, the CPU memory probe, the node
monitor and the CLI's machine defaults all call it, so on Ray-on-Kubernetes every part of the
guard sees the container's limit rather than the machine's RAM.
"""

from __future__ import annotations


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM, narrowed to the cgroup limit.

    In a container psutil reports the machine's RAM; the memory this process may use is the
    cgroup's limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) minus its usage.
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


def read_cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, or (None, None) when unlimited/unknown."""
    for limit_path, usage_path in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as fh:
                text = fh.read().strip()
            if text == "max":
                return None, None
            with open(usage_path) as fh:
                return int(text), int(fh.read().strip())
        except (OSError, ValueError):
            continue
    return None, None


def private_bytes(pid: int) -> int | None:
    """Private (unique set) memory of one process, or None when it is gone or unreadable."""
    import psutil

    try:
        return int(psutil.Process(pid).memory_full_info().uss)
    except (psutil.Error, OSError):
        return None
