"""benchmarks/gate_replay.py: experiment traces replayed through the step gate and the
coordinator's policy give the decisions those take on the same steps."""

from __future__ import annotations

import json
import os
import sys

from raytrain_guard.config import GuardConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import gate_replay  # a script of benchmarks/, not a package


def _write_trace(folder, slow_from=None, num_steps=60):
    """Two ranks, 10 ms steps of 6 ms compute; rank 1 computes 12 ms from ``slow_from`` on
    (rank 0 waits for it in communication)."""
    for rank in (0, 1):
        with open(os.path.join(folder, f"rank{rank}.jsonl"), "w") as fh:
            fh.write(json.dumps({"t": "start", "world_size": 2}) + "\n")
            for step in range(num_steps):
                slow = slow_from is not None and step >= slow_from
                compute = 0.012 if slow and rank == 1 else 0.006
                comm = 0.007 if slow and rank == 0 else 0.001
                jitter = 0.0002 * ((step * 7 + rank) % 5)
                fh.write(json.dumps({"t": "step", "step": step, "total_s": 0.0072 + jitter
                                     + compute - 0.006 + comm, "data_wait_s": 0.0002,
                                     "compute_s": compute + jitter,
                                     "comm_wait_s": comm}) + "\n")


def test_the_coordinator_replay_flags_a_slow_rank_after_straggler_steps(tmp_path):
    _write_trace(tmp_path, slow_from=10)
    flags = gate_replay.replay_coordinator(gate_replay.read_steps(str(tmp_path)), GuardConfig())
    # steps 10-29 are the first 20 slow ones; the policy round after the batch of 20-29 names it
    assert [step for step, _ in flags] == [29]
    assert flags[0][1].startswith("rank 1 (node node) is a straggler (compute): compute 12.")
    assert "at steps 10-29" in flags[0][1]
    # the gate names the slowdown on rank 1 itself within its 3 slow steps
    rows = gate_replay.read_steps(str(tmp_path))[1]
    assert gate_replay.replay(rows, 1, GuardConfig(), checkpoint_every=0)[0] == (12, "compute")


def test_the_coordinator_replay_flags_nothing_on_steady_ranks(tmp_path):
    _write_trace(tmp_path)
    traces = gate_replay.read_steps(str(tmp_path))
    assert gate_replay.replay_coordinator(traces, GuardConfig()) == []
    assert [gate_replay.replay(rows, r, GuardConfig()) for r, rows in traces.items()] == [[], []]
