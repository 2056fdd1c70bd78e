"""The drop-in's step phases timed from hooks, with no mark in the user's loop.

A forward hook on the model puts a gradient hook on its output; when backward reaches the
output, ``forward`` ends (forward and loss) and a callback queued on the autograd engine ends
``backward`` where the backward pass ends. The optimizer's step pre-hook ends ``backward`` again
(what DDP's finishing allreduce and any clipping took is added to it), and its post-hook ends
the step: the optimizer phase is the rest. Per step: a few clock reads and one tensor hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from raytrain_guard.runtime.guard.fail_open import FailOpen


class PhaseHooks:
    """The hooks that mark ``forward`` and ``backward`` on ``step_guard`` and call ``end_step``
    where the optimizer has stepped."""

    def __init__(self, step_guard: Any, *, end_step: Callable[[], None],
                 fail_open: FailOpen) -> None:
        self._step_guard = step_guard
        self._end_step = end_step
        self._fail_open = fail_open
        self._armed = False        # a gradient hook waits on this step's output

    def hook_model(self, module: Any) -> Any:
        """The forward hook on ``module``; returns its handle."""
        return module.register_forward_hook(self._on_forward)

    def hook_optimizer(self, optimizer: Any) -> list[Any]:
        """The step pre- and post-hooks on ``optimizer``; returns their handles."""
        return [optimizer.register_step_pre_hook(self._before_optimizer),
                optimizer.register_step_post_hook(self._after_optimizer)]

    def _on_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._armed or not torch.is_grad_enabled():
            return
        try:
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(self._on_backward_start)
                self._armed = True
        except Exception:  # noqa: BLE001 - fail open: no forward/backward split
            self._fail_open.note("forward hook")

    def _on_backward_start(self, grad: Any) -> None:
        self._armed = False
        self._step_guard.mark("forward")
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        except Exception:  # noqa: BLE001 - the optimizer pre-hook still ends backward
            self._fail_open.note("backward callback")

    def _on_backward_end(self) -> None:
        self._step_guard.mark("backward")

    def _before_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_guard.mark("backward")

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._end_step()


def _first_grad_tensor(output: Any) -> Any:
    """The first tensor of a module's output that backward will reach (None: none)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, Mapping) else \
        output if isinstance(output, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None
