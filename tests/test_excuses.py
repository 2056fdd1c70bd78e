"""The step gate's excuses (raytrain_guard.core.excuses): the module's worked example."""

from __future__ import annotations

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Cause
from raytrain_guard.core.excuses import Excuse, SlowStepExcuses, usual_cpu_waits
from raytrain_guard.core.steps import StepStats

# a window of 10 ms steps whose thread waited 1 ms for a CPU each (its usual wait)
WINDOW = [StepStats(i, 0.010, 0.001, 0.006, comm_wait_s=0.003, cpu_wait_s=0.001,
                    peer_cpu_wait_s=0.001) for i in range(10)]


def _step(step, total_s=0.030, **kw):
    return StepStats(step, total_s, 0.001, 0.006, comm_wait_s=0.003, **kw)


def test_the_worked_example():
    # 30 ms against a median of 10: 20 ms of excess, the line at 10 ms (frac 0.5)
    excuses = SlowStepExcuses(GuardConfig())
    judge = excuses.judge
    assert judge(_step(10, cpu_wait_s=0.013), Cause.COMPUTE, WINDOW, 0.010) is Excuse.HOST
    # the next 3 steps up to 45 ms are its aftermath; a 46 ms one is not, nor step 14
    assert judge(_step(11, 0.045), Cause.COMPUTE, WINDOW, 0.010) is Excuse.AFTERMATH
    assert judge(_step(12, 0.046), Cause.COMPUTE, WINDOW, 0.010) is None
    assert judge(_step(14), Cause.COMPUTE, WINDOW, 0.010) is None
    # slow in communication: 4 ms waited here and 7 ms by a node peer (over the usual 1 each)
    both = _step(20, cpu_wait_s=0.005, peer_cpu_wait_s=0.008)
    assert judge(both, Cause.COMMUNICATION, WINDOW, 0.010) is Excuse.HOST
    # ... but a step slow in compute is judged by its own wait alone
    assert judge(_step(30, cpu_wait_s=0.005, peer_cpu_wait_s=0.008), Cause.COMPUTE, WINDOW,
                 0.010) is None
    # a node peer that worked 10 ms more than this rank's 27 ms (30 less 3 in communication)
    assert judge(_step(40, peer_work_s=0.037), Cause.COMMUNICATION, WINDOW, 0.010) \
        is Excuse.PEER
    assert judge(_step(50, peer_work_s=0.036), Cause.COMMUNICATION, WINDOW, 0.010) is None
    assert (excuses.num_host_starved, excuses.num_waited_for_peer) == (3, 1)


def test_the_usual_wait_is_the_lower_quartile_of_the_read_ones():
    # waits are read on the slower steps only: 3 of 10 steps carry 1 ms, 7 carry 3 ms (median
    # 3 ms, lower quartile 1 ms). A 30 ms step that waited 12 ms: 11 ms over the usual 1 ms,
    # over the 10 ms line; over a median of 3 ms it would be 9 ms, under it
    window = [StepStats(i, 0.010, cpu_wait_s=0.001 if i < 3 else 0.003) for i in range(10)]
    assert usual_cpu_waits(window) == {"cpu_wait_s": 0.001, "peer_cpu_wait_s": 0.0}
    excuses = SlowStepExcuses(GuardConfig())
    assert excuses.judge(_step(10, cpu_wait_s=0.012), Cause.COMPUTE, window, 0.010) \
        is Excuse.HOST
