"""What the planner needs to know about a model and its activations (pure).

Three sources fill these values: a bare parameter count (``--params 7B``), the analytic
transformer description (``core.activations``), and a trace of the user's own model under
PyTorch's memory tracker (``raytrain_guard.trace``). The planner does not care which.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelStats:
    """Parameter-side facts of a model, counted in elements (not bytes).

    ``num_trainable_params`` excludes frozen parameters (no gradient, no optimizer state) and
    counts tied weights once. ``param_numels`` lists the trainable parameters in the order DDP
    buckets them (reverse registration order), when known; it lets the planner reproduce DDP's
    bucket layout exactly (parameters are never split, so buckets overshoot the cap).
    """

    num_params: int
    num_trainable_params: int
    buffer_bytes: int = 0
    largest_unit_params: int = 0        # largest FSDP wrapping unit (all-gather buffer size)
    param_numels: tuple[int, ...] = ()  # trainable params, DDP bucket order; () if unknown
    param_bytes_override: int | None = None  # measured parameter bytes, when traced

    def __post_init__(self) -> None:
        if self.num_trainable_params > self.num_params:
            raise ValueError("num_trainable_params cannot exceed num_params")


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes at the step's peak as a function of micro-batch: ``fixed + per_sample * b``.

    ``bytes_per_sample`` and ``fixed_bytes`` are for the precision the profile was made in
    (traced profiles: the dtype the model actually ran; analytic: from the precision given).
    ``temp_bytes`` is the transient, batch-independent working memory seen at the peak
    (e.g. the optimizer's foreach temporaries), when traced.
    """

    bytes_per_sample: float
    fixed_bytes: int = 0
    temp_bytes: int = 0
    source: str = "analytic"            # "analytic" | "traced" | "given"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def at(self, micro_batch: int) -> int:
        """Activation bytes at the peak for ``micro_batch`` samples."""
        return int(round(self.fixed_bytes + self.bytes_per_sample * micro_batch))
