"""Trace the user's own model: activation bytes without real memory and without a GPU.

:func:`trace_model` builds the model and a sample batch under ``FakeTensorMode`` (shapes and
dtypes, no storage; the ``meta`` device as the fallback) and runs real training steps under
PyTorch's ``MemTracker``: a warm-up step, then one tracked step at each of two micro-batches, to
fit the activations as ``fixed + per_sample * b`` for the planner. What is read from the
tracker, the fallback and its one-line :class:`~raytrain_guard.errors.TraceError`, and the
tracker's limits: docs/planner_trace.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_guard import factories
from raytrain_guard.core.memory_model import OptimizerKind, Precision, coerce_enum
from raytrain_guard.core.model_stats import ActivationProfile, ModelStats
from raytrain_guard.errors import TraceError, check_int
from raytrain_guard.runtime.model import wrap_units

log = logging.getLogger(__name__)

_CATEGORY = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads",
             "Activation": "activations", "Temp": "temp", "Optstate": "optimizer",
             "Other": "activations"}  # "Other" is the input batch (tracked as external)


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


def load_object(spec: str | Callable[..., Any], *, field_name: str) -> Callable[..., Any]:
    """:func:`raytrain_guard.factories.load_object`, raising :class:`TraceError`."""
    return factories.load_object(spec, field_name=field_name, error=TraceError)


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
    build_model = load_object(model_factory, field_name="model")
    build_sample = load_object(sample_factory, field_name="sample")
    loss_fn = load_object(loss, field_name="loss") if loss is not None else None
    errors: list[str] = []
    failures: list[_OpFailure] = []
    names = {"model": _name(model_factory), "sample": _name(sample_factory)}
    for mode in ("fake", "meta"):
        try:
            with _quiet_fake_tensor_log():
                runs, stats, loss_desc = _trace_in_mode(
                    mode, build_model, build_sample, loss_fn, precision, optimizer,
                    micro_batches, names=names)
        except TraceError:
            raise
        except _OpFailure as exc:
            errors.append(f"{mode}: {exc}")
            failures.append(exc)
            log.info("trace on %s device failed: %s", mode, exc)
            continue
        return _result(runs, stats, loss_desc, mode, precision, optimizer, errors,
                       clock() - start)
    raise _untraceable(failures, errors, names)


def _untraceable(failures: list[_OpFailure], errors: list[str],
                 names: Mapping[str, str]) -> TraceError:
    """The TraceError for a model that ran on neither device, by kind of failure."""
    kinds = [_failure_kind(f.exc) for f in failures]
    if "mismatch" in kinds:
        failure = failures[kinds.index("mismatch")]
        return TraceError("sample", f"does not fit the input of model {names['model']}: "
                          f"{failure.where} failed with {_one_line(failure.exc)}",
                          value=names["sample"],
                          fix=f"pass a --sample factory that returns what {names['model']}'s "
                              "forward takes (shape and dtype, batch first; a tuple/dict for "
                              "several arguments)")
    if "data-dependent" in kinds:
        return TraceError("model", "cannot be traced on the fake or the meta device ("
                          + "; ".join(errors) + ")", value=names["model"],
                          fix="make the failing operation shape-only (no .item(), .tolist(), "
                              "numpy() or data-dependent Python branches in forward), or plan "
                              "with --params / --layers instead")
    failure = failures[0]
    return TraceError("model", "cannot be traced on the fake or the meta device: "
                      f"{failure.where} failed with {_one_line(failure.exc)}",
                      value=names["model"],
                      fix="check that one training step runs on a real sample (model factory "
                          "and --sample together), or plan with --params / --layers instead")


# -- internals ---------------------------------------------------------------------------------

class _OpFailure(Exception):
    """The model failed while running on a fake/meta device (message names the op).

    ``where`` says what failed ("operation aten.mm.default", "building the model"), ``exc`` is
    the exception PyTorch or the user's code raised there."""

    def __init__(self, where: str, exc: BaseException, prefix: str = "") -> None:
        super().__init__(f"{prefix}{where} failed: {_one_line(exc)}")
        self.where, self.exc = where, exc


# Failures that come from the sample not fitting the model's forward: PyTorch's shape/dtype
# checks (matmul, conv, norm, embedding, RNN, view, broadcasting) and a wrong argument count.
_MISMATCH = re.compile("|".join((
    r"shapes cannot be multiplied", r"must have (the )?same reduction dim", r"size mismatch",
    r"expected\b.*\binput", r"to have \d+ channels", r"invalid channel dimensions",
    r"must be equal to input_size", r"normalized_shape", r"must match the size of tensor",
    r"is invalid for input of size", r"dimension out of range", r"same dtype",
    r"expected scalar type", r"scalar types?\b.*\bbut got", r"does not match",
    r"forward\(\) (takes|missing|got an unexpected)", r"input.* must have \d+ dim",
)), re.IGNORECASE)

# Failures that come from a forward that needs values, not shapes.
_DATA_DEPENDENT = re.compile("|".join((
    r"DataDependent", r"DynamicOutputShape", r"_local_scalar_dense",
    r"cannot be called on meta tensors", r"copy out of meta tensor", r"numpy", r"nonzero",
    r"data.dependent",
)), re.IGNORECASE)


def _failure_kind(exc: BaseException) -> str:
    """The kind of a trace failure: "data-dependent", "mismatch" (the sample does not fit the
    model's input) or "other"."""
    text = f"{type(exc).__name__}: {exc}"
    if _DATA_DEPENDENT.search(text):
        return "data-dependent"
    if isinstance(exc, (RuntimeError, ValueError, AssertionError, IndexError, TypeError)) \
            and _MISMATCH.search(str(exc).strip().split("\n", 1)[0]):
        return "mismatch"
    return "other"


class _DropFakeTensorErrors(logging.Filter):
    """Drops FakeTensorMode's ``log.exception`` of a failing op: the trace re-raises it as one
    TraceError line, so the logged traceback is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """For one trace attempt only: filter the fake tensor logger's error tracebacks."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    drop = _DropFakeTensorErrors()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)



def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _name(spec) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))


def _call_factory(fn, field_name: str, spec_name: str, **kwargs):
    try:
        return fn(**kwargs)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory raised
        raise _FactoryError(field_name, spec_name, exc) from exc


class _FactoryError(Exception):
    def __init__(self, field_name: str, spec_name: str, exc: BaseException) -> None:
        super().__init__(_one_line(exc))
        self.field_name, self.spec_name, self.exc = field_name, spec_name, exc


def _trace_in_mode(mode, build_model, build_sample, loss_fn, precision, optimizer,
                   micro_batches, names):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = _LastOp()
    if mode == "fake":
        ctx = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        ctx = torch.device("meta")
    try:
        with ctx:
            low = precision in (Precision.BF16, Precision.BF16_MASTER)
            default_dtype = torch.get_default_dtype()
            if low:  # build in bf16 directly: .to() cannot swap tied fake parameters
                torch.set_default_dtype(torch.bfloat16)
            try:
                model = _call_factory(build_model, "model", _name(build_model))
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
            opt = _make_optimizer(model, optimizer)
            takes_batch_size = "batch_size" in _parameters(build_sample)
            sample = _call_factory(build_sample, "sample", _name(build_sample))
            if mode == "meta":
                sample = _map_tensors(sample, lambda t: t.to("meta"))
            b0 = _batch_size(sample)
            sizes = micro_batches or (b0, 2 * b0)
            runs = []
            desc = ""
            with recorder:
                for i, b in enumerate(sizes):
                    batch = _batch_at(sample, b0, b, build_sample, takes_batch_size, mode,
                                      precision)
                    if i == 0:  # warm-up: creates optimizer state
                        desc = _step(model, opt, batch, loss_fn, precision, None)
                    runs.append((b, _tracked_step(model, opt, batch, loss_fn, precision)))
    except TraceError:
        raise
    except _FactoryError as exc:
        if mode == "fake" and exc.field_name == "model" and _looks_like_fake_issue(exc.exc):
            raise _OpFailure("building the model under FakeTensorMode", exc.exc) from None
        raise TraceError(exc.field_name, f"the factory raised {exc}",
                         value=names.get(exc.field_name, exc.spec_name),
                         fix="make the factory run on its own (python -c \"from m import f; "
                             "f()\") and build on whatever device is current") from None
    except Exception as exc:  # noqa: BLE001 - the model cannot run on this device
        where = (f"operation {recorder.last}" if recorder.last
                 else "the model's forward" if recorder.entered else "building the model")
        raise _OpFailure(where, exc) from None
    return runs, stats, desc


def _looks_like_fake_issue(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(w in text for w in ("Fake", "fake", "DataDependent", "meta", "mode"))


class _LastOp:
    """A dispatch mode that remembers the last aten op, to name it when one fails."""

    def __init__(self) -> None:
        self.last: str | None = None
        self.entered = False
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.last = str(func)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        self.entered = True
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def _parameters(fn) -> Mapping[str, Any]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _make_optimizer(model, kind: OptimizerKind):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TraceError("model", "has no trainable parameters", value=type(model).__name__,
                         fix="unfreeze at least one parameter (requires_grad=True)")
    # foreach=False: PyTorch's CPU default; the memory model adds foreach temporaries itself
    if kind is OptimizerKind.SGD:
        return torch.optim.SGD(params, lr=1e-3, foreach=False)
    if kind is OptimizerKind.SGD_MOMENTUM:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    if kind is OptimizerKind.ADAM:
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _map_tensors(obj, fn):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, obj)


def _batch_size(sample) -> int:
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(sample):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    raise TraceError("sample", "holds no tensor with a batch dimension",
                     value=type(sample).__name__,
                     fix="return a tensor, or a tuple/dict of tensors, batch first")


def _batch_at(sample, b0, b, build_sample, takes_batch_size, mode, precision):
    import torch

    if b == b0:
        batch = sample
    elif takes_batch_size:
        batch = _call_factory(build_sample, "sample", _name(build_sample), batch_size=b)
        if mode == "meta":
            batch = _map_tensors(batch, lambda t: t.to("meta"))
    else:
        def resize(t):
            if t.dim() == 0 or t.shape[0] != b0:
                return t
            reps = -(-b // b0)
            return torch.cat([t] * reps, dim=0)[:b].clone()
        batch = _map_tensors(sample, resize)
    if precision in (Precision.BF16, Precision.BF16_MASTER):
        batch = _map_tensors(batch, lambda t: t.to(torch.bfloat16) if t.is_floating_point()
                             else t)
    return batch


def _call_model(model, batch):
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _default_loss(output) -> tuple[Any, str]:
    import torch

    if isinstance(output, torch.Tensor):
        return output.sum(), "sum of the output tensor"
    if isinstance(output, Mapping) or hasattr(output, "to_tuple"):
        items = output.items() if isinstance(output, Mapping) else vars(output).items()
        floats = [(k, v) for k, v in items
                  if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if floats:
            total = sum(v.sum() for _, v in floats)
            return total, "sum of every floating tensor of the output mapping (" \
                + ", ".join(k for k, _ in floats) + ")"
    if isinstance(output, (tuple, list)):
        for i, v in enumerate(output):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.sum(), f"sum of output[{i}], the first floating tensor"
    raise TraceError("loss", "the model output holds no floating tensor to sum",
                     value=type(output).__name__,
                     fix="pass --loss module:fn with fn(model, batch) -> scalar tensor")


def _forward_loss(model, batch, loss_fn, precision):
    import contextlib

    import torch

    amp = torch.autocast("cpu", dtype=torch.bfloat16) \
        if precision is Precision.AMP_BF16 else contextlib.nullcontext()
    with amp:
        if loss_fn is not None:
            return loss_fn(model, batch), "the user's loss function"
        return _default_loss(_call_model(model, batch))


def _step(model, opt, batch, loss_fn, precision, snapshots):
    loss, desc = _forward_loss(model, batch, loss_fn, precision)
    if snapshots is not None:
        snapshots.append(("forward", snapshots.tracker.get_tracker_snapshot("peak")))
    loss.backward()
    del loss
    if snapshots is not None:
        snapshots.append(("backward", snapshots.tracker.get_tracker_snapshot("peak")))
    opt.step()
    opt.zero_grad(set_to_none=True)
    if snapshots is not None:
        snapshots.append(("optimizer", snapshots.tracker.get_tracker_snapshot("peak")))
    return desc


class _Snapshots(list):
    def __init__(self, tracker) -> None:
        super().__init__()
        self.tracker = tracker


def _tracked_step(model, opt, batch, loss_fn, precision):
    """One training step under MemTracker; the peak snapshot after each phase, our categories."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    skip_frozen_grad_hooks(tracker, model)
    tracker.track_external(model, opt, batch)
    snaps = _Snapshots(tracker)
    with tracker:
        _step(model, opt, batch, loss_fn, precision, snaps)
    return [(phase, _categories(snap)) for phase, snap in snaps]


class _NoHook:
    def remove(self) -> None:
        pass


def skip_frozen_grad_hooks(tracker, model=None) -> None:
    """MemTracker (torch 2.13) registers a gradient hook on every parameter and so raises on a
    frozen one ("cannot register a hook on a tensor that doesn't require gradient"). Make its
    hook table answer "already hooked" for every parameter that does not require grad,
    including parameters created later (FSDP2 swaps in unsharded ones on each forward); they
    never get a gradient, so nothing is lost. ``model`` is accepted for symmetry and unused."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    cls = _frozen_aware_handles_type()
    if handles is None or isinstance(handles, cls):
        return  # a later torch: let MemTracker do it its own way
    patched = cls()
    patched.update(handles)
    tracker._param_to_grad_hook_handles = patched


@functools.cache
def _frozen_aware_handles_type():
    from torch.utils.weak import WeakIdKeyDictionary

    class FrozenAwareHandles(WeakIdKeyDictionary):
        def get(self, key, default=None):
            if not getattr(key, "requires_grad", True):
                return (_NoHook(), _NoHook())
            return super().get(key, default)

    return FrozenAwareHandles


def _categories(snapshot) -> dict[str, int]:
    out = dict.fromkeys(("params", "buffers", "grads", "optimizer", "activations", "temp"), 0)
    total = 0
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            if name == "Total":
                total += value
            elif name in _CATEGORY:
                out[_CATEGORY[name]] += value
    out["total"] = total
    return out


def model_stats_of(model) -> ModelStats:
    """Parameter facts of an ``nn.Module`` (works on fake and meta tensors).

    Tied weights count once (``parameters()`` deduplicates); frozen parameters are not
    trainable; ``param_numels`` lists the trainable ones in reverse registration order (DDP's
    bucket order); the largest unit is the largest of :func:`wrap_units` (the units FSDP2
    shards, ``runtime.model``) and of the root's remaining parameters; the largest trainable
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
    fits = []
    for b, snaps in runs:
        upto_bw = max((s for ph, s in snaps if ph != "optimizer"), key=lambda s: s["total"])
        static = upto_bw["params"] + upto_bw["buffers"] + upto_bw["optimizer"]
        fits.append((b, upto_bw["total"] - static))
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
    grads_at_peak = max((s for ph, s in runs[0][1] if ph != "optimizer"),
                        key=lambda s: s["total"])["grads"]
    profile = ActivationProfile(bytes_per_sample=max(per_sample, 0.0), fixed_bytes=fixed,
                                source="traced", notes=tuple(notes), includes_gradients=True,
                                gradient_bytes=min(int(grads_at_peak), fixed))
    for w in warnings:
        log.warning("trace: %s", w)
    return TraceResult(model_stats=stats, activations=profile, micro_batch=b,
                       peak_bytes=peak_snap["total"], peak_phase=phase, breakdown=breakdown,
                       peaks_by_micro_batch={bb: max(s["total"] for _, s in sn)
                                             for bb, sn in runs},
                       trace_s=elapsed, mode=mode, precision=precision, optimizer=optimizer,
                       loss=loss_desc, notes=tuple(notes), warnings=tuple(warnings))
