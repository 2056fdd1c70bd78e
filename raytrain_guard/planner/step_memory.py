"""One training step of the user's model under PyTorch's ``MemTracker``: the optimizer the plan
counts, forward and loss (at the plan's precision), backward, the optimizer step, and the
tracker's peak after each phase in the planner's categories (runs on fake or meta tensors).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

from raytrain_guard.errors import TraceError
from raytrain_guard.planner.memory_model import OptimizerKind, Precision

_CATEGORY = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads",
             "Activation": "activations", "Temp": "temp", "Optstate": "optimizer",
             "Other": "activations"}  # "Other" is the input batch (tracked as external)


def make_optimizer(model, kind: OptimizerKind):
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


def map_tensors(obj, fn):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, obj)


def batch_size_of(sample) -> int:
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(sample):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    raise TraceError("sample", "holds no tensor with a batch dimension",
                     value=type(sample).__name__,
                     fix="return a tensor, or a tuple/dict of tensors, batch first")


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
    import torch

    amp = torch.autocast("cpu", dtype=torch.bfloat16) \
        if precision is Precision.AMP_BF16 else contextlib.nullcontext()
    with amp:
        if loss_fn is not None:
            return loss_fn(model, batch), "the user's loss function"
        return _default_loss(_call_model(model, batch))


def train_step(model, opt, batch, loss_fn, precision, snapshot=lambda phase: None):
    """One training step; ``snapshot(phase)`` after forward, backward and the optimizer."""
    loss, desc = _forward_loss(model, batch, loss_fn, precision)
    snapshot("forward")
    loss.backward()
    del loss
    snapshot("backward")
    opt.step()
    opt.zero_grad(set_to_none=True)
    snapshot("optimizer")
    return desc


def tracked_step(model, opt, batch, loss_fn, precision):
    """One training step under MemTracker; the peak snapshot after each phase, our categories."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    skip_frozen_grad_hooks(tracker, model)
    tracker.track_external(model, opt, batch)
    snaps = []
    with tracker:
        train_step(model, opt, batch, loss_fn, precision,
                   lambda phase: snaps.append((phase, tracker.get_tracker_snapshot("peak"))))
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
