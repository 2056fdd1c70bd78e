"""Host cost of timing FSDP2's collectives on the host clock (gloo), without FSDP or gloo.

The wrapper that :func:`raytrain_guard.runtime.guard.comm_timers.attach_fsdp_comm_timer` puts around each
all-gather and reduce-scatter is called here around a no-op collective; a step of 8 micro-
batch marks and 96 collectives (a 32-layer model: an all-gather per unit in forward and in
backward, a reduce-scatter per unit) is then closed, walking the collectives into the phases::

    python benchmarks/fsdp_timing_cost.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from raytrain_guard.runtime.guard.comm_timers import _TimedAllGather
from raytrain_guard.runtime.guard.timing import StepTimer


class _NoCollective:
    def __call__(self, *args) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    timer = StepTimer()
    gather = _TimedAllGather(_NoCollective(), timer)
    bare = _NoCollective()
    timer.begin_step(0)
    n = 20 * args.rounds
    wrapped = timeit.timeit(lambda: gather(None, None, None, False), number=n) / n
    plain = timeit.timeit(lambda: bare(None, None, None, False), number=n) / n

    def step() -> None:
        timer.begin_step(1)
        for _ in range(4):
            for _ in range(12):
                gather(None, None, None, False)
            timer.mark("forward")
            for _ in range(12):
                gather(None, None, None, False)
            timer.mark("backward")
        timer.finish_step(1)

    def marks_only() -> None:
        timer.begin_step(1)
        for _ in range(4):
            for _ in range(24):
                bare(None, None, None, False)
            timer.mark("forward")
            timer.mark("backward")
        timer.finish_step(1)

    per_step = [timeit.timeit(step, number=100) / 100 for _ in range(args.rounds // 100)]
    baseline = [timeit.timeit(marks_only, number=100) / 100 for _ in range(args.rounds // 100)]
    print(f"wrapper per collective: {1e6 * (wrapped - plain):.2f} us over the call itself")
    print(f"step of 96 timed collectives and 8 marks: {1e6 * statistics.median(per_step):.1f} us;"
          f" the same with untimed collectives: {1e6 * statistics.median(baseline):.1f} us")


if __name__ == "__main__":
    main()
