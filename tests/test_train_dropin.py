"""The drop-in's pieces in one process, without Ray running: the budget rule, the loader that
keeps the user's settings, phase timing from hooks, the stop agreement, options and planning.
The real TorchTrainer run is tests/test_train_dropin_ray.py."""

from __future__ import annotations

import functools
import logging
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from examples import toy
from raytrain_guard.config import GuardConfig
from raytrain_guard.coordination.context import WorkerContext
from raytrain_guard.errors import ConfigError, InputError
from raytrain_guard.runtime.dropin.loader import DropInDataLoader, lower_to_budget
from raytrain_guard.runtime.dropin.worker import WorkerGuard
from raytrain_guard.units import MiB

CFG = GuardConfig()


# -- the budget rule ---------------------------------------------------------------------------

@pytest.mark.parametrize("workers,prefetch,cost,budget,expected", [
    # 4 x 2 x 10 MiB = 80 MiB within 100 MiB: kept
    (4, 2, 10 * MiB, 100 * MiB, (4, 2)),
    # 4 x 4 x 10 MiB = 160 MiB > 100 MiB: prefetch 100 // (4 x 10) = 2, workers kept
    (4, 4, 10 * MiB, 100 * MiB, (4, 2)),
    # 8 x 2 x 20 MiB = 320 MiB; even prefetch 1 (160 MiB) is over: 100 // 20 = 5 workers x 1
    (8, 2, 20 * MiB, 100 * MiB, (5, 1)),
    # no workers: nothing in flight
    (0, 0, 20 * MiB, 10 * MiB, (0, 0)),
])
def test_lower_to_budget(workers, prefetch, cost, budget, expected):
    w, p, warning = lower_to_budget(workers, prefetch, cost, budget, CFG)
    assert (w, p) == expected
    assert w * p * cost <= budget
    if expected == (workers, prefetch):
        assert warning is None
    else:
        assert "host_prefetch_frac 5% of host RAM per GPU" in warning
        assert f"{workers} workers x prefetch_factor {prefetch}" in warning
        assert warning.endswith("fits")


def test_lowered_text_names_the_figures():
    _, _, warning = lower_to_budget(4, 4, 10 * MiB, 100 * MiB, CFG)
    assert warning.startswith("prefetch_factor 4 lowered to 2: 4 workers x prefetch_factor 4 x "
                              "10.0 MiB per batch = 160.0 MiB in flight exceed the host "
                              "prefetch budget of 100.0 MiB")


# -- the loader --------------------------------------------------------------------------------

def _loader(**kwargs):
    return DropInDataLoader.keeping_settings(
        toy.make_dataset(64), 8, config=CFG, world_rank=0, world_size=1, gpus_per_node=1,
        cpus_per_node=4, watch_worker_memory=False, **kwargs)


def test_given_settings_over_the_host_budget_are_lowered_with_a_warning(caplog):
    # a batch of 8 toy samples is ~1.1 KiB; 100 KiB of host RAM x 5 % = 5 KiB budget:
    # 2 workers x prefetch 4 x 1.1 KiB = 8.8 KiB is over, 2 x 2 fits
    with caplog.at_level(logging.WARNING):
        loader = _loader(num_workers=2, prefetch_factor=4, host_memory_bytes=100 * 1024)
    assert (loader.plan.num_workers, loader.plan.prefetch_factor) == (2, 2)
    assert loader.plan.host_bytes <= loader.plan.budget_bytes
    [warning] = loader.lowered
    assert warning.startswith("prefetch_factor 4 lowered to 2: 2 workers x prefetch_factor 4")
    assert any("host_prefetch_frac" in r.getMessage() for r in caplog.records)
    assert not any("exceed the host prefetch budget" in w for w in loader.plan.warnings)
    loader.close()


def test_given_settings_within_budget_are_kept_and_set_epoch_works():
    loader = _loader(num_workers=1, prefetch_factor=4, persistent_workers=True,
                     multiprocessing_context="fork")
    settings = loader.settings()
    assert (settings["num_workers"], settings["prefetch_factor"], settings["persistent_workers"],
            settings["multiprocessing_context"]) == (1, 4, True, "fork")
    assert settings["lowered"] == []
    loader.sampler.set_epoch(0)                # the current epoch: a no-op
    assert len(list(loader)) == len(loader) == 8
    loader.sampler.set_epoch(3)
    assert loader.epoch == 3 and loader.sampler.num_replicas == 1
    loader.close()


def _guard(**settings) -> WorkerGuard:
    from raytrain_guard.runtime.dropin.worker import WorkerSettings
    return WorkerGuard(WorkerSettings(**settings), context=WorkerContext())


def test_prepare_data_loader_keeps_what_ray_drops_and_sizes_what_was_left_out():
    guard = _guard()
    kept = guard.prepare_data_loader(DataLoader(toy.make_dataset(64), batch_size=8, shuffle=True,
                                                num_workers=1, prefetch_factor=4,
                                                persistent_workers=True,
                                                multiprocessing_context="spawn"))
    assert isinstance(kept, DropInDataLoader) and kept.shuffle
    assert {k: kept.settings()[k] for k in ("num_workers", "prefetch_factor",
                                            "persistent_workers", "multiprocessing_context")} \
        == {"num_workers": 1, "prefetch_factor": 4, "persistent_workers": True,
            "multiprocessing_context": "spawn"}
    sized = guard.prepare_data_loader(DataLoader(toy.make_dataset(64), batch_size=8))
    assert sized.plan.num_workers >= CFG.min_workers_per_gpu     # torch's 0: the guard sizes it
    assert sized.plan.prefetch_factor >= 1 and not sized.shuffle
    assert guard.loader is kept                  # the first loader times the steps
    guard.close()


def test_a_loader_the_guard_cannot_rebuild_is_left_alone(caplog):
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    guard = _guard()
    plain = DataLoader(Stream(), batch_size=2)
    with caplog.at_level(logging.WARNING):
        assert guard.prepare_data_loader(plain) is plain
    assert "IterableDataset" in caplog.text


# -- phases from hooks, the stop ---------------------------------------------------------------

class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.01)
        return grad


class _Timed(torch.nn.Module):
    """10 ms in forward, 10 ms in backward."""

    def __init__(self):
        super().__init__()
        self.net = toy.make_model()

    def forward(self, x):
        time.sleep(0.01)
        return _SlowBackward.apply(self.net(x))


def _train(guard, steps, *, stop_at=None):
    model = guard.prepare_model(_Timed())
    loader = guard.prepare_data_loader(DataLoader(toy.make_dataset(256, delay_s=0.001),
                                                  batch_size=4, shuffle=True))
    opt = guard.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    stopped = None
    for batch in loader:                       # the loop marks nothing
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if stop_at is not None and guard.step == stop_at:
            guard.request_stop("asked by the test")
        if guard.should_stop():
            stopped = guard.step
            assert guard.should_checkpoint()
            break
        if guard.step == steps:
            break
    return stopped


def test_phases_are_timed_from_hooks_with_no_mark_in_the_loop():
    guard = _guard(measure_bandwidth=False)
    _train(guard, 12)
    window = guard.step_guard.gate.window
    assert len(window) >= 8
    for s in window:
        assert s.forward_s >= 0.009            # the model's 10 ms sleep (and the loss)
        assert s.backward_s >= 0.009           # the slow backward node
        assert s.optimizer_s > 0
        assert s.data_wait_s > 0               # the loader opened the step and timed its batch
        parts = s.data_wait_s + s.forward_s + s.backward_s + s.comm_wait_s + s.optimizer_s
        assert parts <= s.total_s + 1e-9
    guard.close()
    assert guard._hooks == []


def test_a_stop_request_is_agreed_at_the_next_agreement_step():
    guard = _guard(measure_bandwidth=False)
    k = CFG.lockstep_every_steps
    stopped = _train(guard, 100, stop_at=3)
    assert stopped == k and guard.stopped_at == k          # carried by the round at step K
    assert "asked by the test" in guard.stop_reason
    summary = guard.summary()
    assert summary["stopped_early"] and summary["stopped_at"] == [k]
    assert summary["loader"][0]["batch_size"] == 4
    guard.close()


# -- options and planning ----------------------------------------------------------------------

def test_guard_options_from_a_dict_and_bad_input_names_the_field():
    from raytrain_guard.train import GuardOptions

    options = GuardOptions.coerce({"namespace": "ns", "headroom_frac": 0.2})
    assert options.namespace == "ns" and options.config.headroom_frac == 0.2
    assert GuardOptions.coerce(GuardConfig(headroom_frac=0.3)).config.headroom_frac == 0.3
    with pytest.raises(ConfigError, match="headroom"):
        GuardOptions.coerce({"headroom": 0.2})
    with pytest.raises(InputError, match="guard.micro_batch"):
        GuardOptions(model_factory=toy.make_model)
    with pytest.raises(InputError, match="guard.sample_factory"):
        GuardOptions(model_factory=toy.make_model, micro_batch=8)
    with pytest.raises(InputError, match="guard.strategy"):
        GuardOptions(strategy="horovod")


def test_a_plan_that_does_not_fit_is_refused_before_ray_starts():
    import ray
    from ray.train import ScalingConfig

    from raytrain_guard.cluster.planning import PlanDoesNotFit
    from raytrain_guard.train import GuardOptions, TorchTrainer

    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2),
                           guard=GuardOptions(model_factory=toy.make_model, micro_batch=8,
                                              dataset_factory=functools.partial(
                                                  toy.make_dataset, 64), loss_fn=toy.loss_fn,
                                              device_memory_bytes=64 * 1024))
    with pytest.raises(PlanDoesNotFit, match="does not fit"):
        trainer.fit()
    assert not ray.is_initialized()


def test_the_guarded_train_function_keeps_the_arity():
    import inspect

    from raytrain_guard.runtime.dropin.worker import WorkerSettings
    from raytrain_guard.train import get_guard, guarded_train_func

    seen = []
    one = guarded_train_func(lambda config: seen.append((config, get_guard())), WorkerSettings())
    zero = guarded_train_func(lambda: seen.append(get_guard()), WorkerSettings())
    assert len(inspect.signature(one).parameters) == 1
    assert len(inspect.signature(zero).parameters) == 0
    one({"a": 1})
    zero()
    assert seen[0][0] == {"a": 1} and seen[0][1] is not seen[1]   # a fresh guard per run


def test_the_report_counts_attempts_from_failures_and_the_coordinator():
    from raytrain_guard.cluster.summary import build_report

    failure = {"kind": "exception", "ranks": [1], "errors": {"1": "RuntimeError()"}}
    report = {"kind": "report"}
    # a failure before any step: the coordinator issued one attempt, the run had two
    two = build_report("r", {"attempt": 1}, {}, [failure, report], 1.0, straggler_frac=0.1)
    assert (two.attempts, len(two.worker_failures), two.num_reports) == (2, 1, 1)
    # the run failed for good on its second failure: two attempts, both ended by a failure
    assert build_report("r", {"attempt": 2}, {}, [failure, failure], 1.0, straggler_frac=0.1,
                        finished=False).attempts == 2
    assert build_report("r", {}, {}, [], 1.0, straggler_frac=0.1).attempts == 1


def test_the_controller_callback_pickles_and_never_raises():
    import pickle

    from raytrain_guard.train import GuardCallback

    callback = pickle.loads(pickle.dumps(GuardCallback("run-x", "ns")))
    assert (callback.run_id, callback.namespace) == ("run-x", "ns")
    # no coordinator (no Ray here): the controller must not fail because of the guard
    callback.after_report(None, [{"loss": 1.0}], None)
    callback.after_exception(None, {1: RuntimeError("boom")})


def test_the_coordinator_actor_takes_stops_summaries_and_controller_events():
    from raytrain_guard.cluster.actors import _CoordinatorActor
    from raytrain_guard.core.decisions import Action, Decision

    coordinator = _CoordinatorActor("run-x", CFG, 0, "my_run")
    stop = Decision.from_dict(coordinator.request_stop("operator asks"))
    assert (stop.action, stop.scope, stop.step) == (Action.CHECKPOINT_AND_STOP, "cluster", None)
    assert [d["decision_id"] for d in coordinator.decisions_since(0)] == [stop.decision_id]
    coordinator.report_summary(1, {"step": 7})
    coordinator.report_summary(1, {"step": 9})          # the latest per rank
    assert coordinator.summaries() == {1: {"step": 9}}
    for _ in range(1005):
        coordinator.record_train_event({"kind": "report"})
    assert len(coordinator.train_events()) == 1000      # bounded
