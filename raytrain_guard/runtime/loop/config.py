"""``train_loop_config`` of the shared train loop, validated: :class:`LoopConfig`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import GuardError, InputError, check_int
from raytrain_guard.factories import load_object
from raytrain_guard.planner.memory_model import Strategy
from raytrain_guard.runtime.dist.model import parse_strategy

#: the keys with a fixed set of values, and the fix that names them
_CHOICES = {
    "precision": (("fp32", "amp-bf16", "bf16-master", "bf16"),
                  "use one of fp32, amp-bf16, bf16-master, bf16"),
    "fsdp_grad_sync": (("auto", "every_micro_batch", "last_micro_batch"),
                       "use every_micro_batch, last_micro_batch or auto"),
    "epoch_tail": (("short_step", "drop"),
                   "use 'short_step' (train the leftover micro-batches) or 'drop'"),
}
#: integer keys and their least value; those of _OPTIONAL may be None
_INTS = {"micro_batch": 1, "grad_accum": 1, "epochs": 1, "seed": 0, "max_steps": 1,
         "checkpoint_every_steps": 1, "num_workers": 0, "stop_check_every_steps": 1,
         "global_batch": 1, "device_memory_bytes": 1}
_OPTIONAL = {"max_steps", "checkpoint_every_steps", "num_workers", "stop_check_every_steps",
             "global_batch", "device_memory_bytes"}
REHEARSAL = "raytrain_guard.experiment.rehearsal:build_rehearsal"


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
    faults: Mapping[str, Any] = field(default_factory=dict)   # the rehearsal's to apply
    rehearsal: Callable[..., Any] | None = None  # (config, world_rank=, device=) -> Rehearsal
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
    device_memory_bytes: int | None = None       # caps a CUDA card; on CPU a rehearsal's card
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
        for name in ("scheduler_factory", "rehearsal"):
            if values.get(name) is not None:
                values[name] = load_object(values[name], field_name=name)
        for name, least in _INTS.items():
            if name in values and (values[name] is not None or name not in _OPTIONAL):
                values[name] = check_int(name, values[name], at_least=least)
        for name, (choices, fix) in _CHOICES.items():
            if values.get(name, choices[0]) not in choices:
                raise InputError(name, f"unknown {name}", value=values[name], fix=fix)
        for name, fix in (("bucket_cap_mb", "omit it to use the recommended cap"),
                          ("max_grad_norm", "e.g. 1.0, or leave it out for no clipping")):
            if values.get(name) is not None and not float(values[name]) > 0:
                raise InputError(name, "must be > 0", value=values[name], fix=fix)
        values["strategy"] = parse_strategy(values.get("strategy", Strategy.DDP))
        guard = values.get("guard", {})
        if isinstance(guard, Mapping):
            values["guard"] = GuardConfig.from_dict(guard, source="train_loop_config['guard']")
        elif not isinstance(guard, GuardConfig):
            raise InputError("guard", "must be a dict of GuardConfig fields",
                             value=type(guard).__name__, fix="e.g. {'headroom_frac': 0.2}")
        source = values.get("decision_source")
        if source is not None and not callable(getattr(source, "poll", None)):
            raise InputError("decision_source", "has no poll(step, stats) method",
                             value=type(source).__name__, fix="pass a LockstepDecisionSource")
        faults = values.get("faults", {})
        if not isinstance(faults, Mapping):
            raise InputError("faults", "must be a dict", value=faults,
                             fix="e.g. {'delay': [{'seconds': 0.05, 'ranks': [1]}]}")
        if faults and values.get("rehearsal") is None:
            raise InputError("faults", "are applied by a rehearsal, and none is set",
                             value=sorted(faults), fix=f"set rehearsal={REHEARSAL!r}")
        if values.get("precision") in ("bf16-master", "bf16") and values["strategy"] not in (
                Strategy.FSDP_FULL, Strategy.FSDP_GRAD_OP):
            raise InputError("precision", "bf16-master and bf16 are FSDP2 mixed-precision "
                             "policies", value=values["precision"],
                             fix="use amp-bf16 (autocast) under ddp or zero1, or an fsdp strategy")
        return cls(**values)

    @property
    def every_checkpoint(self) -> int:
        return self.checkpoint_every_steps or self.guard.checkpoint_every_steps

    @property
    def every_stop_check(self) -> int:
        """Steps between stop agreements; by default the stop flag rides on the lockstep
        round (one collective, not two)."""
        return self.stop_check_every_steps or self.guard.lockstep_every_steps


def call_factory(name: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``factory(*args, **kwargs)``; what it raises becomes an InputError naming ``name``."""
    try:
        return factory(*args, **kwargs)
    except GuardError:
        raise
    except Exception as exc:
        raise InputError(name, f"raised {type(exc).__name__}: {exc}",
                         value=getattr(factory, "__name__", repr(factory)),
                         fix="fix the factory; it runs on every worker") from exc


def check_loss(loss: Any, step: int) -> None:
    import torch
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError("loss_fn", f"must return a scalar tensor (step {step})", value=shape,
                         fix="reduce the loss, e.g. .mean(), and return a tensor")
