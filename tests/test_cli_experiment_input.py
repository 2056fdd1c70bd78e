"""``raytrain-guard experiment`` refuses bad input in one line, exit 2, before any Ray starts,
and hands ``--repeat`` and ``--address`` to the runner (the runs themselves:
tests/test_experiment_repeats_ray.py)."""

from __future__ import annotations

import pytest

from raytrain_guard import cli
from raytrain_guard.experiment import runner


@pytest.mark.parametrize("argv,names", [
    (["--max-failures", "-1"], "--max-failures: must be an integer >= 0"),
    (["--micro-batch", "0"], "--micro-batch: must be an integer >= 1"),
    (["--repeat", "0"], "--repeat: must be an integer >= 1"),
    (["--fault", "slow_compute:rank=1,start=-2,factor=3"], "start=-2"),
    (["--nodes", "0"], "--nodes: must be an integer >= 1"),
    (["--nodes", "3"], "--nodes: must be 1..--workers 2"),
    (["--nodes", "2", "--fault", "slow_compute:node=2,start=4,factor=3"],
     "--fault: slow_compute: node 2 is not below --nodes 2"),
    (["--fault", "slow_compute:node=1,start=4,factor=3"], "use node 0..0, or pass --nodes 2"),
    (["--nodes", "2", "--fault", "slow_compute:node=1,rank=0,start=4,factor=3"],
     "node and rank(s) together"),
    (["--node-memory", "lots"], "--node-memory"),
    (["--node-memory", "4GiB", "--address", "10.0.0.1:6379"],
     ("--node-memory: gives the nodes of a local cluster the experiment starts their own "
      "memory; this run joins a running cluster")),
])
def test_bad_experiment_input_is_one_line_exit_2(argv, names, capsys, monkeypatch):
    import ray
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started on bad input"))
    assert cli.main(["experiment", *argv]) == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err, err


def test_the_python_api_refuses_a_node_fault_past_its_nodes():
    from raytrain_guard.errors import InputError
    from raytrain_guard.experiment.faults import parse_fault
    from raytrain_guard.experiment.runner import ExperimentSetup

    setup = ExperimentSetup(faults=(parse_fault("slow_compute:node=1,start=4,factor=3"),))
    with pytest.raises(InputError) as err:
        setup.check()
    assert err.value.field == "--fault" and "node 1" in err.value.problem
    assert "--nodes 2" in err.value.fix


def test_repeat_and_address_reach_the_runner(monkeypatch, tmp_path, capsys):
    seen = {}

    def experiment(setup, out_dir, progress=None, address=None):
        seen.update(repeat=setup.repeat, seed=setup.seed, address=address)
        raise RuntimeError("stopped here")
    monkeypatch.setattr(runner, "run_experiment", experiment)
    monkeypatch.chdir(tmp_path)
    argv = ["experiment", "--repeat", "3", "--seed", "4", "--address", "10.0.0.1:6379"]
    assert cli.main(argv) == 1
    assert seen == {"repeat": 3, "seed": 4, "address": "10.0.0.1:6379"}
    assert "could not run: RuntimeError: stopped here" in capsys.readouterr().err
    assert cli.main(["experiment"]) == 1 and seen["address"] is None     # RAY_ADDRESS: runner's
