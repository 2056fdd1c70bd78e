"""GPU-like steps on a CPU: the host waits a set time in forward and backward, as it waits on a
GPU's kernels, so the host's own noise is as small a share of a step as beside a GPU
(docs/experiment.md). A forward hook sleeps the forward's share and, through an identity
autograd function on the output, the backward's when backward starts; sleeping frees the CPU.
Device time scales with the micro-batch's elements; ``slow_compute`` stretches it
(:attr:`DeviceTime.factor`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from raytrain_guard.planner.batches import iter_tensors

#: backward takes about twice the forward's time (two matmuls per forward matmul)
BACKWARD_SHARE = 2 / 3


class DeviceTime:
    """``step_s`` of device time per micro-batch of the first batch's size, a third of it in
    forward and two thirds in backward; :meth:`attach` puts it on a model."""

    def __init__(self, step_s: float, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.step_s = float(step_s)
        self.factor = 1.0           # slow_compute: the device runs this many times slower
        self._sleep = sleep
        self._nominal_elements: int | None = None

    def attach(self, model: torch.nn.Module) -> Any:
        """Wait on ``model``'s every forward (and its backward); returns the hook's handle."""
        return model.register_forward_hook(self._on_forward)

    def seconds(self, elements: int) -> float:
        """The device time of a micro-batch of ``elements`` input elements."""
        if self._nominal_elements is None:
            self._nominal_elements = max(1, elements)
        return self.step_s * self.factor * elements / self._nominal_elements

    def _on_forward(self, module: Any, args: Any, output: Any) -> Any:
        total = self.seconds(sum(t.numel() for t in iter_tensors(args)))
        self._sleep(total * (1 - BACKWARD_SHARE))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _WaitInBackward.apply(output, total * BACKWARD_SHARE, self._sleep)
        return output


class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward first waits ``seconds`` (the device's backward time)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, seconds: float, sleep: Any) -> torch.Tensor:
        ctx.seconds, ctx.sleep = seconds, sleep
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        ctx.sleep(ctx.seconds)
        return grad, None, None
