"""The cgroup memory reader (raytrain_guard.runtime.host_memory) on fake filesystem roots: the
tightest limit over the process's own cgroup and those above it, usage as the working set."""

from __future__ import annotations

from raytrain_guard.runtime.host_memory import read_cgroup_memory

GiB = 1024**3
V1_UNLIMITED = "9223372036854771712"


def _write(root, path, text):
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _v1(root, folder, limit, usage, inactive=0):
    base = f"sys/fs/cgroup/memory/{folder}".rstrip("/")
    _write(root, f"{base}/memory.limit_in_bytes", f"{limit}\n")
    _write(root, f"{base}/memory.usage_in_bytes", f"{usage}\n")
    _write(root, f"{base}/memory.stat", f"cache 5\ntotal_inactive_file {inactive}\n")


def test_a_limit_above_the_process_cgroup_binds_and_inactive_cache_is_not_used(tmp_path):
    # a Slurm job: the job's cgroup is limited to 8 GiB, the step's inside it is not, and the
    # machine's root is not; 1 GiB of the job's 6 GiB is inactive page cache
    _write(tmp_path, "proc/self/cgroup", "4:memory:/slurm/job_1/step_0\n0::/\n")
    _v1(tmp_path, "", V1_UNLIMITED, 20 * GiB)
    _v1(tmp_path, "slurm", V1_UNLIMITED, 7 * GiB)
    _v1(tmp_path, "slurm/job_1", 8 * GiB, 6 * GiB, inactive=1 * GiB)
    _v1(tmp_path, "slurm/job_1/step_0", V1_UNLIMITED, 6 * GiB)
    assert read_cgroup_memory(str(tmp_path)) == (8 * GiB, 5 * GiB)


def test_the_cgroup_with_the_least_room_binds(tmp_path):
    # v2: the pod allows 16 GiB and holds 15; its container allows 4 and holds 1
    _write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    for folder, limit, usage in (("kubepods/pod1", 16 * GiB, 15 * GiB),
                                 ("kubepods/pod1/ctr", 4 * GiB, 1 * GiB)):
        _write(tmp_path, f"sys/fs/cgroup/{folder}/memory.max", f"{limit}\n")
        _write(tmp_path, f"sys/fs/cgroup/{folder}/memory.current", f"{usage}\n")
    _write(tmp_path, "sys/fs/cgroup/kubepods/pod1/memory.stat", "inactive_file 0\n")
    assert read_cgroup_memory(str(tmp_path)) == (16 * GiB, 15 * GiB)


def test_a_container_that_mounts_its_own_cgroup_at_the_root(tmp_path):
    # no cgroup namespace: /proc/self/cgroup names the host's path, which the container's
    # mount does not have; the mount's root is the container's cgroup
    _write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n")
    _v1(tmp_path, "", 2 * GiB, 1 * GiB)
    assert read_cgroup_memory(str(tmp_path)) == (2 * GiB, 1 * GiB)


def test_no_limit_anywhere_or_nothing_readable(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", "max\n")
    assert read_cgroup_memory(str(tmp_path)) == (None, None)
    assert read_cgroup_memory(str(tmp_path / "nothing")) == (None, None)
