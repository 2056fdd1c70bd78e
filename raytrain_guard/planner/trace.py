"""Trace the user's own model: activation bytes without real memory and without a GPU.

:func:`trace_model` builds the model and a sample batch under ``FakeTensorMode`` (shapes and
dtypes, no storage; the ``meta`` device as the fallback) and runs real training steps under
PyTorch's ``MemTracker`` (:mod:`~raytrain_guard.planner.step_memory`): a warm-up step, then one
tracked step at each of two micro-batches, to fit the activations as ``fixed + per_sample * b``
for the planner. A model that runs on neither device is one TraceError line
(:mod:`~raytrain_guard.planner.untraceable`). What is read from the tracker and its limits:
docs/planner_trace.md.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_guard.errors import TraceError, check_int
from raytrain_guard.factories import load_object
from raytrain_guard.planner.fsdp_units import wrap_units
from raytrain_guard.planner.memory_model import OptimizerKind, Precision, coerce_enum
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats
from raytrain_guard.planner.step_memory import (
    batch_size_of,
    make_optimizer,
    map_tensors,
    tracked_step,
    train_step,
)
from raytrain_guard.planner.untraceable import (
    FactoryError,
    OpFailure,
    call_factory,
    last_op_recorder,
    looks_like_fake_issue,
    quiet_fake_tensor_log,
    untraceable,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceResult:
    """What one trace found. Byte counts are per rank, single process, no DDP.

    ``peak_bytes`` is the tracked peak of the step at ``micro_batch``; ``breakdown`` holds each
    category's bytes at that moment; ``peak_phase`` is "forward", "backward" or "optimizer".
    ``peaks_by_micro_batch`` holds the traced peak of every traced micro-batch.
    """

    model_stats: ModelStats
    activations: ActivationProfile
    micro_batch: int
    peak_bytes: int
    peak_phase: str
    breakdown: Mapping[str, int]
    peaks_by_micro_batch: Mapping[int, int]
    trace_s: float
    mode: str                       # "fake" or "meta"
    precision: Precision
    optimizer: OptimizerKind
    loss: str                       # how the loss was computed
    notes: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)


def trace_model(model_factory: str | Callable[[], Any], sample_factory: str | Callable[..., Any],
                *, loss: str | Callable[[Any, Any], Any] | None = None,
                precision: Precision | str = Precision.FP32,
                optimizer: OptimizerKind | str = OptimizerKind.ADAMW,
                micro_batches: tuple[int, int] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> TraceResult:
    """Trace one steady-state training step of the user's model (docs/planner_trace.md).

    ``loss(model, batch) -> scalar``; by default the model is called with the batch (a dict as
    keyword arguments, a tuple/list as positional arguments, anything else as one argument) and
    the output is summed: a tensor itself, the first tensor of a tuple/list, every floating
    tensor of a dict or ``ModelOutput``. ``precision`` "amp-bf16" runs forward and loss under
    CPU bf16 autocast; "bf16" and "bf16-master" cast the model and the floating inputs to bf16.
    ``micro_batches``: the two batch sizes to trace (default ``(b0, 2 * b0)``, ``b0`` the sample
    factory's own batch size); the first is the one ``peak_bytes`` reports.
    """
    start = clock()
    precision = coerce_enum(Precision, precision, "precision", error=TraceError)
    optimizer = coerce_enum(OptimizerKind, optimizer, "optimizer", error=TraceError)
    if micro_batches is not None:
        fix = "e.g. (1, 2), or leave it out for (b0, 2 b0)"
        if len(micro_batches) != 2 or micro_batches[0] == micro_batches[1]:
            raise TraceError("micro_batches", "must be two different positive integers",
                             value=micro_batches, fix=fix)
        for i, b in enumerate(micro_batches):
            check_int(f"micro_batches[{i}]", b, at_least=1, error=TraceError, fix=fix)
    build_model = load_object(model_factory, field_name="model", error=TraceError)
    build_sample = load_object(sample_factory, field_name="sample", error=TraceError)
    loss_fn = None if loss is None else load_object(loss, field_name="loss", error=TraceError)
    errors: list[str] = []
    failures: list[OpFailure] = []
    names = {"model": _name(model_factory), "sample": _name(sample_factory)}
    for mode in ("fake", "meta"):
        try:
            with quiet_fake_tensor_log():
                runs, stats, loss_desc = _trace_in_mode(
                    mode, build_model, build_sample, loss_fn, precision, optimizer,
                    micro_batches, names=names)
        except TraceError:
            raise
        except OpFailure as exc:
            errors.append(f"{mode}: {exc}")
            failures.append(exc)
            log.info("trace on %s device failed: %s", mode, exc)
            continue
        return _result(runs, stats, loss_desc, mode, precision, optimizer, errors,
                       clock() - start)
    raise untraceable(failures, errors, names)


def _name(spec) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def _trace_in_mode(mode, build_model, build_sample, loss_fn, precision, optimizer,
                   micro_batches, names):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = last_op_recorder()
    ctx = FakeTensorMode(allow_non_fake_inputs=True) if mode == "fake" else torch.device("meta")
    try:
        with ctx:
            low = precision in (Precision.BF16, Precision.BF16_MASTER)
            default_dtype = torch.get_default_dtype()
            if low:  # build in bf16 directly: .to() cannot swap tied fake parameters
                torch.set_default_dtype(torch.bfloat16)
            try:
                model = call_factory(build_model, "model", _name(build_model))
            finally:
                torch.set_default_dtype(default_dtype)
            if not isinstance(model, torch.nn.Module):
                raise TraceError("model", "the factory did not return a torch.nn.Module",
                                 value=type(model).__name__,
                                 fix="return the model instance from the factory")
            if low and any(p.is_floating_point() and p.dtype != torch.bfloat16
                           for p in model.parameters()):
                model = model.to(torch.bfloat16)
            model.train()
            stats = model_stats_of(model)
            opt = make_optimizer(model, optimizer)
            takes_batch_size = "batch_size" in _parameters(build_sample)
            sample = call_factory(build_sample, "sample", _name(build_sample))
            if mode == "meta":
                sample = map_tensors(sample, lambda t: t.to("meta"))
            b0 = batch_size_of(sample)
            sizes = micro_batches or (b0, 2 * b0)
            runs = []
            desc = ""
            with recorder:
                for i, b in enumerate(sizes):
                    batch = _batch_at(sample, b0, b, build_sample, takes_batch_size, mode,
                                      precision)
                    if i == 0:  # warm-up: creates optimizer state
                        desc = train_step(model, opt, batch, loss_fn, precision)
                    runs.append((b, tracked_step(model, opt, batch, loss_fn, precision)))
    except TraceError:
        raise
    except FactoryError as exc:
        if mode == "fake" and exc.field_name == "model" and looks_like_fake_issue(exc.exc):
            raise OpFailure("building the model under FakeTensorMode", exc.exc) from None
        raise TraceError(exc.field_name, f"the factory raised {exc}",
                         value=names.get(exc.field_name, exc.spec_name),
                         fix="make the factory run on its own (python -c \"from m import f; "
                             "f()\") and build on whatever device is current") from None
    except Exception as exc:  # noqa: BLE001 - the model cannot run on this device
        where = (f"operation {recorder.last}" if recorder.last
                 else "the model's forward" if recorder.entered else "building the model")
        raise OpFailure(where, exc) from None
    return runs, stats, desc


def _parameters(fn) -> Mapping[str, Any]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _batch_at(sample, b0, b, build_sample, takes_batch_size, mode, precision):
    import torch

    if b == b0:
        batch = sample
    elif takes_batch_size:
        batch = call_factory(build_sample, "sample", _name(build_sample), batch_size=b)
        if mode == "meta":
            batch = map_tensors(batch, lambda t: t.to("meta"))
    else:
        def resize(t):
            if t.dim() == 0 or t.shape[0] != b0:
                return t
            reps = -(-b // b0)
            return torch.cat([t] * reps, dim=0)[:b].clone()
        batch = map_tensors(sample, resize)
    if precision in (Precision.BF16, Precision.BF16_MASTER):
        batch = map_tensors(batch, lambda t: t.to(torch.bfloat16) if t.is_floating_point()
                             else t)
    return batch


def model_stats_of(model) -> ModelStats:
    """Parameter facts of an ``nn.Module`` (works on fake and meta tensors).

    Tied weights count once (``parameters()`` deduplicates); frozen parameters are not
    trainable; ``param_numels`` lists the trainable ones in reverse registration order (DDP's
    bucket order); the largest unit is the largest of :func:`wrap_units` (the units FSDP2
    shards, ``runtime.dist.model``) and of the root's remaining parameters; the largest trainable
    unit counts only parameters that get a gradient (the reduce-scatter buffer); the root
    unit (what no unit claims) and the largest other unit are given apart, since FSDP2 keeps
    the root gathered through backward.
    """
    params = list(model.parameters())
    num = sum(p.numel() for p in params)
    trainable = [p for p in params if p.requires_grad]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    units, claimed = [], set()
    for unit in wrap_units(model):
        unit_params = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in unit_params)
        units.append(unit_params)
    units.append([p for p in params if id(p) not in claimed])  # the root unit
    sizes = [sum(p.numel() for p in u) for u in units]
    trainable_sizes = [sum(p.numel() for p in u if p.requires_grad) for u in units]
    return ModelStats(num_params=num, num_trainable_params=sum(p.numel() for p in trainable),
                      buffer_bytes=buffers, largest_unit_params=max(sizes) or num,
                      largest_trainable_unit_params=max(trainable_sizes),
                      param_numels=tuple(p.numel() for p in reversed(trainable)),
                      root_unit_params=sizes[-1] if len(sizes) > 1 else None,
                      largest_block_unit_params=max(sizes[:-1]) if len(sizes) > 1 else None)


def _result(runs, stats, loss_desc, mode, precision, optimizer, errors, elapsed) -> TraceResult:
    # each run's peak up to the end of backward, less the static bytes: its activations
    upto_bw = [max((s for ph, s in snaps if ph != "optimizer"), key=lambda s: s["total"])
               for _, snaps in runs]
    fits = [(b, peak["total"] - peak["params"] - peak["buffers"] - peak["optimizer"])
            for (b, _), peak in zip(runs, upto_bw)]
    (b1, a1), (b2, a2) = fits[0], fits[1]
    per_sample = (a2 - a1) / (b2 - b1) if b2 != b1 else a1 / b1
    fixed = max(0, int(round(a1 - per_sample * b1)))
    b, snaps = runs[0]
    peak_snap = max((s for _, s in snaps), key=lambda s: s["total"])
    phase = next(ph for ph, s in snaps if s["total"] == peak_snap["total"])
    breakdown = {k: v for k, v in peak_snap.items() if k != "total"}
    notes = [f"traced under {'FakeTensorMode' if mode == 'fake' else 'the meta device'} "
             f"with MemTracker at micro-batches {b1} and {b2}, precision {precision.value} "
             f"(plan at the same precision)",
             f"loss: {loss_desc}",
             f"activations(b) = {fixed} + {per_sample:.1f} * b bytes "
             f"(backward-side peak less params, buffers, optimizer state)"]
    warnings = [f"fake device failed, used meta: {e}" for e in errors]
    if per_sample <= 0:
        warnings.append("activations did not grow with the micro-batch: check that the sample "
                        "factory's batch dimension is dim 0")
    profile = ActivationProfile(bytes_per_sample=max(per_sample, 0.0), fixed_bytes=fixed,
                                source="traced", notes=tuple(notes), includes_gradients=True,
                                gradient_bytes=min(int(upto_bw[0]["grads"]), fixed))
    for w in warnings:
        log.warning("trace: %s", w)
    return TraceResult(model_stats=stats, activations=profile, micro_batch=b,
                       peak_bytes=peak_snap["total"], peak_phase=phase, breakdown=breakdown,
                       peaks_by_micro_batch={bb: max(s["total"] for _, s in sn)
                                             for bb, sn in runs},
                       trace_s=elapsed, mode=mode, precision=precision, optimizer=optimizer,
                       loss=loss_desc, notes=tuple(notes), warnings=tuple(warnings))
