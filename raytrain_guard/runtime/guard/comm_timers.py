"""Communication timers: the time a step waited for its collectives, into a
:class:`~raytrain_guard.runtime.guard.timing.StepTimer` (``StepStats.comm_wait_s``).

:func:`attach_comm_timer` wraps DDP's communication hook; :func:`attach_fsdp_comm_timer` wraps
FSDP2's collectives; :func:`attach_fsdp1_comm_timer` FSDP1's gradient reduction (Lightning's
``RayFSDPStrategy``); :func:`attach_comm_timers` picks the one a wrapped model needs. What the
figure means: docs/train_loop.md, "Step timings".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.nn.parallel import DistributedDataParallel

from raytrain_guard.errors import InputError
from raytrain_guard.runtime.guard.timing import StepTimer

logger = logging.getLogger(__name__)


def attach_comm_timers(module: Any, timer: StepTimer, *, world_rank: int,
                       hook: Callable | None = None,
                       before_reduce_scatter: Callable[[], None] | None = None) -> None:
    """Time the communication of a DDP or FSDP2 ``module`` into ``timer`` (any other module has
    none to time). Fails open: a failure (a communication hook of the user's own, say) is
    logged, and the steps' communication wait reads 0."""
    try:
        if isinstance(module, DistributedDataParallel):
            attach_comm_timer(module, timer, hook=hook)
        elif hasattr(module, "set_custom_reduce_scatter"):          # FSDP2's root module
            attach_fsdp_comm_timer(module, timer, before_reduce_scatter=before_reduce_scatter)
        elif isinstance(module, FullyShardedDataParallel):          # FSDP1
            attach_fsdp1_comm_timer(module, timer)
    except Exception:  # fail open
        logger.warning("rank %d: communication timer not attached", world_rank, exc_info=True)


def attach_comm_timer(ddp_model: Any, timer: StepTimer, *, hook: Callable | None = None,
                      state: Any = None) -> None:
    """Register a DDP communication hook that times each bucket's allreduce into ``timer``:
    it stamps when the last bucket is ready, calls ``hook`` (default ``allreduce_hook``, DDP's
    own) with ``state``, and stamps its future's completion. DDP takes one hook per model:
    call this instead of ``register_comm_hook``.
    """
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        hook = allreduce_hook
    if not hasattr(ddp_model, "register_comm_hook"):
        raise InputError("ddp_model", "has no register_comm_hook",
                         value=type(ddp_model).__name__,
                         fix="pass the DistributedDataParallel-wrapped model")
    inner = hook

    def timed_hook(hook_state, bucket):  # unannotated: DDP checks hook annotations
        _fail_open(timer.record_bucket_ready, bucket.is_last())
        future = inner(hook_state, bucket)

        def done(fut: Any) -> Any:
            _fail_open(timer.record_bucket_done)
            return fut.value()

        return future.then(done)

    ddp_model.register_comm_hook(state, timed_hook)


_hook_failed = False


def _fail_open(fn: Callable, *args: Any) -> None:
    """Timing must never break the allreduce: log the first failure and go on."""
    global _hook_failed
    try:
        fn(*args)
    except Exception:
        if not _hook_failed:
            _hook_failed = True
            logger.warning("communication timing failed; communication waits read 0 from now "
                           "on where it fails", exc_info=True)


def attach_fsdp_comm_timer(module: Any, timer: StepTimer, *,
                           before_reduce_scatter: Callable[[], None] | None = None) -> int:
    """Time FSDP2's all-gathers and reduce-scatters into ``timer`` (``set_custom_all_gather``,
    ``set_custom_reduce_scatter`` around PyTorch's default ones); returns the units timed.

    On the host clock (gloo) every collective blocks the training thread: every unit's are
    timed, and their whole time is communication wait, taken out of the phase it fell in. On
    CUDA only the root unit's reduce-scatter, the last of the backward, is timed, and its tail
    after the last gradient counts, as for DDP. ``before_reduce_scatter`` runs before each
    timed reduce-scatter (the seam of a slow link). A unit that refuses custom collectives
    (several parameter groups, ``set_symm_mem_for_comm``) is left untimed.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError as exc:   # the defaults are not public: degrade, never break the run
        logger.warning("FSDP2 communication not timed: %s", exc)
        return 0
    gather = _TimedAllGather(DefaultAllGather(), timer)
    scatter = _TimedReduceScatter(DefaultReduceScatter(), timer, before_reduce_scatter)
    timed = 0
    units = module.modules() if timer.on_host else [module]
    for unit in units:
        if not isinstance(unit, FSDPModule):
            continue
        try:
            if timer.on_host:
                unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
            timed += 1
        except ValueError as exc:
            logger.warning("FSDP2 unit %s not timed: %s", type(unit).__name__, exc)
    return timed


def attach_fsdp1_comm_timer(module: Any, timer: StepTimer) -> bool:
    """Time FSDP1's gradient reduction into ``timer`` through its communication hook (one for
    every unit, registered on the root before its first forward): PyTorch's default hook, a
    reduce-scatter (an all-reduce under ``NO_SHARD``) with the default pre- and post-division,
    run to completion; its blocked time on the host clock is communication wait. Returns
    whether it was attached: on CUDA the hook's collectives run on a side stream, which the
    host clock does not see, so FSDP1 is left untimed there (a log line says so); its
    all-gathers are not timed."""
    if not timer.on_host:
        logger.info("FSDP1 communication not timed on CUDA: its waits read 0")
        return False
    from torch.distributed.algorithms._comm_hooks import default_hooks

    if module.sharding_strategy is ShardingStrategy.NO_SHARD:
        def timed(state: Any, grad: Any) -> None:
            start = timer.now()
            default_hooks.allreduce_hook(state, grad)
            _fail_open(timer.record_collective, start, timer.now())
    else:
        def timed(state: Any, grad: Any, output: Any) -> None:  # type: ignore[misc]
            start = timer.now()
            default_hooks.reduce_scatter_hook(state, grad, output)
            _fail_open(timer.record_collective, start, timer.now())

    module.register_comm_hook(default_hooks.DefaultState(module.process_group), timed)
    return True


class _TimedAllGather:
    """FSDP2's default all-gather, run to completion and timed on the host clock."""

    def __init__(self, inner: Any, timer: StepTimer) -> None:
        self.inner = inner
        self.timer = timer

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                 async_op: bool = False) -> Any:
        start = self.timer.now()
        # synchronous: FSDP2 reads a None work as an all-gather that is already complete
        self.inner(output_tensor, input_tensor, group, False)
        _fail_open(self.timer.record_collective, start, self.timer.now())
        return None


class _TimedReduceScatter:
    """FSDP2's default reduce-scatter, timed: the blocked time on the host clock, the tail
    after the last gradient on CUDA (events on the reduce-scatter stream)."""

    def __init__(self, inner: Any, timer: StepTimer,
                 before: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.timer = timer
        self.before = before

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if not self.timer.on_host:
            _fail_open(self.timer.record_bucket_ready, True)
            if self.before is not None:
                self.before()
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            _fail_open(self.timer.record_bucket_done)
            return work
        start = self.timer.now()
        if self.before is not None:
            self.before()
        self.inner(output_tensor, input_tensor, group, op, False)
        _fail_open(self.timer.record_collective, start, self.timer.now())
        return None
