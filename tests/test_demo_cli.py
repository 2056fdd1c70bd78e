"""The README's main job, as a user runs it: `raytrain-guard demo` in a fresh process.

It starts its own embedded Ray cluster, trains 2 gloo workers with the guard, rehearses a GPU
at 89 % memory and a straggler on rank 1, and prints a summary. Slow (~1 min): one run (marked
``ray``). The other tests are without Ray: a demo that cannot run is refused before Ray starts,
the live line, the temporary storage.
"""

import io
import os
import re
import subprocess
import sys
import types

import pytest

from raytrain_guard.cluster import demo
from raytrain_guard.cluster.launcher import PlanDoesNotFit, ProgressPrinter, RunSummary
from raytrain_guard.errors import InputError


@pytest.mark.ray
def test_demo_trains_applies_a_release_on_both_ranks_and_names_the_straggler(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_guard.cli", "demo", "--epochs", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"run \w+: 128/128 steps on 2 ranks", out), out[-3000:]
    # the scripted 89 % GPU becomes one cluster decision applied at one step on both ranks
    assert re.search(r"release_cache at step \d+ on ranks \[0, 1\]", out), out[-3000:]
    # the injected 30 ms compute delay on rank 1 is named, and rank 0 is seen waiting on it
    assert "rank 1: compute" in out and "waiting on rank 1" in out, out[-3000:]
    assert "Traceback" not in proc.stderr



@pytest.mark.parametrize("workers, epochs, steps", [
    (2, 8, 128),      # 128 samples per rank, 16 micro-batches of 8, 8 epochs
    (3, 1, 11),       # ceil(256 / 3) = 86 samples per rank: 10 full micro-batches and a part
    (32, 2, 2),       # one micro-batch per rank and epoch
])
def test_demo_steps_count_as_the_train_loop_does(workers, epochs, steps):
    assert demo.demo_steps(workers, epochs) == steps


@pytest.mark.parametrize("workers, epochs, flag", [(0, 12, "--workers"), (2, 0, "--epochs")])
def test_demo_refuses_counts_below_one(workers, epochs, flag):
    with pytest.raises(InputError) as err:
        demo.demo_steps(workers, epochs)
    assert err.value.field == flag


@pytest.mark.parametrize("fitting, upper, largest", [
    (20, 32, 20), (20, 19, 19), (0, 32, 0), (1, 1, 1)])
def test_largest_fitting(fitting, upper, largest):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= fitting
    assert demo.largest_fitting(fits, upper) == largest
    assert len(calls) <= 6                  # a binary search over 1..32


def _plans(fitting: int):
    """A planner stand-in: up to ``fitting`` workers fit (each rank's share of RAM shrinks)."""
    def plan_for(workers):
        return types.SimpleNamespace(
            fits=workers <= fitting, micro_batch=8, grad_accum=1, total_bytes=1 << 30,
            budget_bytes=(20 << 30) // workers, setup=types.SimpleNamespace(world_size=workers),
            arithmetic=f"1.0 GiB over the budget of {workers} ranks",
            warnings=("even micro-batch 1 does not fit: shard the model (--strategy fsdp-full), "
                      "add ranks to shard over (--workers)",))
    return plan_for


def test_too_many_workers_for_the_data_is_bad_input_naming_the_largest_that_runs():
    with pytest.raises(InputError) as err:
        demo.plan_demo({}, 64, plan_for=_plans(20))
    assert err.value.field == "--workers" and err.value.value == 64
    assert "pass --workers 20 or fewer" in str(err.value) and "\n" not in str(err.value)


def test_a_plan_that_does_not_fit_names_only_what_the_demo_can_change():
    with pytest.raises(PlanDoesNotFit) as err:
        demo.plan_demo({}, 24, plan_for=_plans(20))
    text = str(err.value)
    assert "1.0 GiB over the budget of 24 ranks" in text and "pass --workers 20 or fewer" in text
    # the planner's advice is for `raytrain-guard plan`: demo has no --strategy, no force
    assert "--strategy" not in text and "force" not in text and "add ranks" not in text
    assert demo.plan_demo({}, 2, plan_for=_plans(20)).fits


def test_demo_cli_refuses_64_workers_before_starting_ray(capsys, monkeypatch):
    from raytrain_guard.cli import main
    monkeypatch.setattr(demo, "plan_run", lambda cfg, num_workers, **kw:
                        _plans(20)(num_workers))
    monkeypatch.setattr(demo, "load_toy", _fake_toy)
    monkeypatch.setitem(sys.modules, "ray", None)           # starting Ray would fail
    assert main(["demo", "--workers", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain-guard demo: error: --workers: ")


def _fake_toy():
    return types.SimpleNamespace(make_model=print, make_dataset=print, make_optimizer=print,
                                 loss_fn=print)


def _status(step):
    return {"latest_step": step, "ranks": {0: {"memory_frac": 0.04}}, "step_p50_s": 0.035,
            "step_p99_s": 0.05, "active_decisions": []}


def test_progress_in_a_log_prints_a_step_once():
    out = io.StringIO()
    show = ProgressPrinter(out, 192, started=0.0, clock=iter([1.0, 2.0, 3.0]).__next__)
    for step in (179, 189, 189):          # the run ends: the last step is read again
        show(_status(step))
    lines = out.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["step 179/192", "step 189/192"]


def test_the_demo_removes_its_temporary_storage(monkeypatch):
    seen = {}

    def fake_launch(train_loop_config, **kw):
        seen["storage"] = kw["storage_path"]
        assert os.path.isdir(kw["storage_path"])
        return RunSummary(run_id="r", steps=1, total_steps=1, world_size=2, global_batch=16,
                          wall_s=1.0, samples_per_s=None, step_p50_s=None, step_p99_s=None,
                          data_wait_frac=None)
    monkeypatch.setattr(demo, "launch", fake_launch)
    monkeypatch.setattr(demo, "plan_demo", lambda config, workers: None)
    monkeypatch.setattr(demo, "load_toy", _fake_toy)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(
        init=lambda **kw: None, shutdown=lambda: None))
    out = io.StringIO()
    demo.run_demo(num_workers=2, epochs=1, rehearse=False, out=out)
    assert seen["storage"] and not os.path.exists(seen["storage"])
