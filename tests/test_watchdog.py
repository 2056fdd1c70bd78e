"""The hang watchdog, on a clock stepped by hand."""

from raytrain_guard.runtime.guard.watchdog import StepWatchdog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _watchdog(clock, fired, **kw):
    return StepWatchdog(floor_s=kw.pop("floor_s", 10.0), step_multiple=20.0, on_hang=fired.append,
                        world_rank=1, node_id="abcdef0123456789", clock=clock, start_thread=False,
                        **kw)


def _steps(wd, clock, n, seconds):
    for step in range(n):
        wd.begin(step)
        clock.now += seconds
        wd.end()


def test_a_step_over_the_floor_is_named_with_its_rank_node_and_phase():
    clock, fired = Clock(), []
    wd = _watchdog(clock, fired)
    _steps(wd, clock, 5, 0.01)
    wd.begin(5)
    clock.now += 0.002
    wd.enter("forward")
    clock.now += 9.9
    assert wd.check() is None                        # 9.902 s: under the 10 s floor
    clock.now += 0.2
    record = wd.check()
    assert record is fired[0]
    assert (record["world_rank"], record["step"], record["phase"]) == (1, 5, "forward")
    assert record["step_for_s"] == 10.102 and record["phase_for_s"] == 10.1
    assert "abcdef01" in record["reason"] and "in forward" in record["reason"]
    clock.now += 5
    assert wd.check() is None and len(fired) == 1     # once


def test_a_long_median_raises_the_limit_and_nothing_is_watched_before_warm_up_or_between_steps():
    clock, fired = Clock(), []
    wd = _watchdog(clock, fired, floor_s=1.0, warmup_steps=3)
    wd.begin(0)
    clock.now += 50
    assert wd.check() is None                        # no median yet: start-up is not a hang
    wd.end()
    _steps(wd, clock, 3, 2.0)                        # median 2.0 s -> limit 20 x 2 = 40 s
    assert wd.limit_s() == 40.0
    clock.now += 100
    assert wd.check() is None                        # between steps: a checkpoint, a barrier
    wd.begin(4)
    clock.now += 39
    assert wd.check() is None
    clock.now += 2
    assert wd.check()["limit_s"] == 40.0


def test_a_failing_handler_does_not_raise_out_of_the_watchdog():
    clock = Clock()

    def boom(record):
        raise RuntimeError("no disk")

    wd = StepWatchdog(floor_s=1.0, step_multiple=2.0, on_hang=boom, clock=clock,
                      start_thread=False, warmup_steps=0)
    wd.begin(0)
    clock.now += 2
    assert wd.check() is not None
