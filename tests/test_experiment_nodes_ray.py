"""The experiment on two Ray nodes of this machine, one rank on each, with a node slowed.

:func:`~raytrain_guard.experiment.runner.run_experiment` with ``nodes=2`` starts its own
``ray.cluster_utils.Cluster`` (a head and one worker node, each with its own node id and CPUs)
and spreads the two workers over it. ``slow_compute:node=1`` triples the device time of every
rank the second node holds: only that rank's, resolved inside the workers. The coordinator,
told to name a straggler after 4 slow steps and to hear the ranks every 2, names node 1 as a
node, and the arm's detection carries the node's place (``node_index`` 1) beside its Ray node
id. The act arm alone, 32 steps: 85-140 s on 2 busy cores, all but a few seconds of it Ray
starting its nodes and the workers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytest.importorskip("matplotlib")

from raytrain_guard.experiment.analysis import read_ranks
from raytrain_guard.experiment.faults import parse_fault
from raytrain_guard.experiment.runner import ExperimentSetup, run_experiment

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

#: the coordinator hears every 2 steps, decides up to 4 times a second and names a straggler
#: after 4 slow steps (named at step 11 of 24 here when the box is quiet)
FAST_GUARD = {"straggler_steps": 4, "report_every_steps": 2, "lockstep_every_steps": 2,
              "decision_interval_s": 0.25}


def test_a_slow_node_is_named_as_that_node_and_slows_only_its_rank(tmp_path):
    setup = ExperimentSetup(faults=(parse_fault("slow_compute:node=1,start=4,factor=3",
                                                num_nodes=2),),
                            arms=("act",), num_workers=2, nodes=2, max_steps=32,
                            max_failures=0, guard=FAST_GUARD)
    result = run_experiment(setup, str(tmp_path / "out"), namespace="rtg_nodes_test")
    act = result["arms"]["act"]
    assert act["completed"], act["error"]

    node_ids = result["node_ids"]
    assert len(node_ids) == 2 and node_ids[0] != node_ids[1]
    # one rank on each node: read from the ranks' own start records
    assert [n["ranks"] for n in act["nodes"]] in ([[0], [1]], [[1], [0]]), act["nodes"]
    slow_rank = act["nodes"][1]["ranks"][0]
    traces = read_ranks(str(tmp_path / "out" / "act" / "trace"))
    started_on = {rank: {r["node_id"] for r in records if r.get("t") == "start"}
                  for rank, records in traces.items()}
    assert started_on[slow_rank] == {node_ids[1]} and started_on[1 - slow_rank] == {node_ids[0]}
    # the slowed rank's own compute (forward + backward, no waiting) from step 5 on: x3 adds
    # 100 ms of waited device time (2 x 50 ms); half of it stands clear of a loaded box's
    # noise, which stretches the other rank's compute too (a ratio of 2 did not, at load 5)
    compute = {rank: sorted(r["compute_s"] for r in records
                            if r.get("t") == "step" and r["step"] >= 5)
               for rank, records in traces.items()}
    median = {rank: values[len(values) // 2] for rank, values in compute.items()}
    assert median[slow_rank] - median[1 - slow_rank] > 0.05, median

    named = act["fault_detection"][0]
    assert named["node_index"] == 1 and named["ranks"] == [slow_rank], named
    assert named["named_at_step"] is not None and named["node_id"] == node_ids[1], named
    # every detection of a node carries its place beside its id; the compute ones are node 1
    # (on a loaded box node 0 may also be flagged for communication: its rank waits for the
    # slow one inside the allreduce, at a round where the compute excess dipped)
    node_detections = [d for d in act["detections"] if d.get("target") == "node"]
    assert all(d["node_index"] == node_ids.index(d["node_id"]) for d in node_detections)
    assert {d["node_index"] for d in node_detections if d["cause"] == "compute"} == {1}
