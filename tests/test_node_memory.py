"""``--node-memory``: a Ray node's processes in their own memory cgroup, where the kernel's OOM
killer acts on that node alone (experiment/node_memory.py). Real cgroups where this machine
lets root make them (cgroup v1); the error otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raytrain_guard.errors import InputError
from raytrain_guard.experiment.node_memory import NodeCgroups, oom_kills, own_cgroup
from raytrain_guard.units import MiB

# a raylet: one child started before it is confined, one after (which inherits the cgroup)
RAYLET = """
import subprocess, sys
early = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(early.pid, flush=True)
sys.stdin.readline()
late = subprocess.Popen([sys.executable, "-c",
                         "import time; b = bytearray(b'\\\\x01') * (256 << 20); time.sleep(120)"])
print(late.pid, flush=True)
print(late.wait(), flush=True)
early.kill()
"""


def _cgroup_of(pid: int) -> str:
    return own_cgroup(f"/proc/{pid}/cgroup")


def test_a_node_cgroup_holds_the_raylets_processes_and_its_oom_killer_acts_there_alone():
    try:
        cgroups = NodeCgroups(128 * MiB)
    except InputError as exc:
        pytest.skip(f"no writable cgroup v1 memory controller here: {exc}")
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        early = int(raylet.stdout.readline())
        path = cgroups.confine(1, raylet.pid)
        assert path.endswith("_node1") and cgroups.paths == [path]
        mine = _cgroup_of(os.getpid())
        for pid in (raylet.pid, early):
            assert _cgroup_of(pid) == os.path.join(mine, os.path.basename(path))
        raylet.stdin.write("go\n")
        raylet.stdin.flush()
        int(raylet.stdout.readline())
        # 256 MiB in a 128 MiB node: the kernel kills it there; this test's process, outside
        # the node, is untouched
        assert int(raylet.stdout.readline()) == -9
        assert cgroups.oom_kills() == [1] and oom_kills(path) == 1
        assert raylet.wait(timeout=30) == 0
    finally:
        raylet.kill()
        raylet.wait()
    cgroups.close()
    assert not os.path.exists(path)


def test_without_a_writable_memory_controller_it_says_how_to_run(tmp_path):
    with pytest.raises(InputError) as err:
        NodeCgroups(128 * MiB, mount=str(tmp_path / "no-mount"))
    assert err.value.field == "--node-memory"
    assert "leave --node-memory out" in str(err.value)


def test_a_nodes_raylet_is_found_or_named_as_missing():
    from types import SimpleNamespace

    from raytrain_guard.experiment.ray_cluster import _raylet_pid

    started = SimpleNamespace(process=SimpleNamespace(pid=4321))
    assert _raylet_pid(SimpleNamespace(all_processes={"raylet": [started]})) == 4321
    with pytest.raises(RuntimeError, match="does not list its raylet"):
        _raylet_pid(SimpleNamespace(all_processes={}))
