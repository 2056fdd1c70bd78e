"""``train_loop_config`` of the shared train loop, validated: :class:`LoopConfig`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.memory_model import Strategy
from raytrain_guard.errors import GuardError, InputError, check_int
from raytrain_guard.factories import load_object
from raytrain_guard.runtime.model import parse_strategy


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """``train_loop_config`` of the template, validated (:meth:`from_dict`)."""

    model_factory: Callable[[], Any]
    dataset_factory: Callable[[], Any]
    optimizer_factory: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any], Any]
    micro_batch: int = 32
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None
    checkpoint_every_steps: int | None = None    # None: guard.checkpoint_every_steps
    seed: int = 0
    strategy: Strategy = Strategy.DDP
    bucket_cap_mb: float | None = None           # None: recommended from gradients + curve
    gradient_as_bucket_view: bool = False
    measure_bandwidth: bool = True
    stop_check_every_steps: int | None = None    # None: guard.lockstep_every_steps
    num_workers: int | None = None               # DataLoader workers; None: the guard sizes
    guard: GuardConfig = field(default_factory=GuardConfig)
    decision_source: Any = None
    audit_dir: str | None = None                 # per-rank consumed sample ids (JSON lines)
    sample_id_key: str = "id"
    faults: Mapping[str, Any] = field(default_factory=dict)
    scheduler_factory: Callable[[Any], Any] | None = None  # (optimizer) -> LR scheduler
    max_grad_norm: float | None = None           # clip the global gradient norm to this
    precision: str = "fp32"                      # the planner's: fp32, amp-bf16, bf16-master, bf16
    fsdp_grad_sync: str = "auto"                 # FSDP with accumulation: every_micro_batch
                                                 # (sharded gradients, more traffic),
                                                 # last_micro_batch, or auto (the plan's)
    epoch_tail: str = "short_step"               # an epoch's leftover micro-batches: a shorter
                                                 # last step ("short_step") or none ("drop")
    allow_global_batch_change: bool = False      # a resume at another world size may change it
    global_batch: int | None = None              # samples per optimizer step over all ranks:
                                                 # the layout follows the world size (elastic)
    act: bool = True                             # False: measure and decide, apply nothing
    split_spikes: bool = True                    # price each micro-batch on the card and run
                                                 # an oversized one in pieces (FSDP: ranks
                                                 # agree per micro-batch, one tiny allreduce)
    restart_after_stop: bool = False             # a guard stop checkpoints, then restarts
    device_memory_bytes: int | None = None       # a simulated card of this size on CPU
    trace_dir: str | None = None                 # per-rank JSON lines of steps and events

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoopConfig:
        """Validate ``train_loop_config``; each bad entry raises InputError naming it."""
        if not isinstance(data, Mapping):
            raise InputError("train_loop_config", "must be a dict", value=type(data).__name__,
                             fix="pass train_loop_config={...} to TorchTrainer")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                raise InputError(f"train_loop_config[{key!r}]", "unknown key",
                                 fix=f"did you mean {close[0]!r}?" if close
                                 else "known keys: " + ", ".join(sorted(known)))
        values = dict(data)
        for name in ("model_factory", "dataset_factory", "optimizer_factory", "loss_fn"):
            if name not in values:
                raise InputError(f"train_loop_config[{name!r}]", "missing",
                                 fix="pass a 'module:attr' string or a callable")
            values[name] = load_object(values[name], field_name=name)
        for name, lo in (("micro_batch", 1), ("grad_accum", 1), ("epochs", 1), ("seed", 0)):
            if name in values:
                values[name] = check_int(name, values[name], at_least=lo)
        for name in ("max_steps", "checkpoint_every_steps", "num_workers",
                     "stop_check_every_steps", "global_batch"):
            if values.get(name) is not None:
                values[name] = check_int(name, values[name],
                                         at_least=0 if name == "num_workers" else 1)
        if "strategy" in values:
            values["strategy"] = parse_strategy(values["strategy"])
        guard = values.get("guard", {})
        if isinstance(guard, Mapping):
            values["guard"] = GuardConfig.from_dict(guard, source="train_loop_config['guard']")
        elif not isinstance(guard, GuardConfig):
            raise InputError("guard", "must be a dict of GuardConfig fields",
                             value=type(guard).__name__, fix="e.g. {'headroom_frac': 0.2}")
        if values.get("bucket_cap_mb") is not None and not float(values["bucket_cap_mb"]) > 0:
            raise InputError("bucket_cap_mb", "must be > 0", value=values["bucket_cap_mb"],
                             fix="omit it to use the recommended cap")
        source = values.get("decision_source")
        if source is not None and not callable(getattr(source, "poll", None)):
            raise InputError("decision_source", "has no poll(step, stats) method",
                             value=type(source).__name__, fix="pass a LockstepDecisionSource")
        if not isinstance(values.get("faults", {}), Mapping):
            raise InputError("faults", "must be a dict", value=values["faults"],
                             fix="e.g. {'delay': [{'seconds': 0.05, 'ranks': [1]}]}")
        if values.get("scheduler_factory") is not None:
            values["scheduler_factory"] = load_object(values["scheduler_factory"],
                                                      field_name="scheduler_factory")
        if values.get("max_grad_norm") is not None and not float(values["max_grad_norm"]) > 0:
            raise InputError("max_grad_norm", "must be > 0", value=values["max_grad_norm"],
                             fix="e.g. 1.0, or leave it out for no clipping")
        precisions = ("fp32", "amp-bf16", "bf16-master", "bf16")
        if values.get("precision", "fp32") not in precisions:
            raise InputError("precision", "unknown precision", value=values["precision"],
                             fix="use one of " + ", ".join(precisions))
        if values.get("precision") in ("bf16-master", "bf16") and \
                parse_strategy(values.get("strategy", "ddp")) not in (Strategy.FSDP_FULL,
                                                                      Strategy.FSDP_GRAD_OP):
            raise InputError("precision", "bf16-master and bf16 are FSDP2 mixed-precision "
                             "policies", value=values["precision"],
                             fix="use amp-bf16 (autocast) under ddp or zero1, or an fsdp strategy")
        if values.get("fsdp_grad_sync", "auto") not in ("auto", "every_micro_batch",
                                                        "last_micro_batch"):
            raise InputError("fsdp_grad_sync", "unknown", value=values["fsdp_grad_sync"],
                             fix="use every_micro_batch, last_micro_batch or auto")
        if values.get("epoch_tail", "short_step") not in ("short_step", "drop"):
            raise InputError("epoch_tail", "unknown", value=values["epoch_tail"],
                             fix="use 'short_step' (train the leftover micro-batches) or 'drop'")
        if values.get("device_memory_bytes") is not None:
            values["device_memory_bytes"] = check_int("device_memory_bytes",
                                                      values["device_memory_bytes"], at_least=1)
        return cls(**values)

    @property
    def every_checkpoint(self) -> int:
        return self.checkpoint_every_steps or self.guard.checkpoint_every_steps

    @property
    def every_stop_check(self) -> int:
        """Steps between stop agreements. Default ``guard.lockstep_every_steps``, so that the
        stop flag rides on the lockstep round (one collective, not two): the tiny all_reduce
        costs about 2 ms per call on gloo on a 2-core box (benchmarks/stop_flag_cost.py), half
        a toy step; a rank that hits critical memory then waits at most K - 1 steps."""
        return self.stop_check_every_steps or self.guard.lockstep_every_steps


def _call_factory(name: str, factory: Callable[..., Any], *args: Any) -> Any:
    try:
        return factory(*args)
    except GuardError:
        raise
    except Exception as exc:
        raise InputError(name, f"raised {type(exc).__name__}: {exc}",
                         value=getattr(factory, "__name__", repr(factory)),
                         fix="fix the factory; it runs on every worker") from exc


def _check_loss(loss: Any, step: int) -> None:
    import torch
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError("loss_fn", f"must return a scalar tensor (step {step})", value=shape,
                         fix="reduce the loss, e.g. .mean(), and return a tensor")
