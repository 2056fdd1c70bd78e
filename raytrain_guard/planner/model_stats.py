"""What the planner needs to know about a model and its activations (pure).

Three sources fill these values: a bare parameter count (``--params 7B``), the analytic
transformer description (``planner.activations``), and a trace of the user's own model under
PyTorch's memory tracker (``raytrain_guard.planner.trace``). The planner does not care which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_guard.errors import PlanInputError


@dataclass(frozen=True)
class ModelStats:
    """Parameter-side facts of a model, counted in elements (not bytes).

    ``num_trainable_params`` excludes frozen parameters (no gradient, no optimizer state) and
    counts tied weights once. ``param_numels`` lists the trainable parameters in the order DDP
    buckets them (reverse registration order), when known; it lets the planner reproduce DDP's
    bucket layout exactly (parameters are never split, so buckets overshoot the cap).
    ``largest_unit_params`` is the largest FSDP unit (all-gather buffer size);
    ``largest_trainable_unit_params`` the most trainable parameters one unit holds (its
    reduce-scatter buffer: FSDP reduce-scatters only gradients, so a frozen unit has none).
    ``None`` means unknown: the unit is assumed fully trainable (the safe side).
    ``root_unit_params`` is FSDP's root unit (what no block holds: embedding, output head, final
    norm), which FSDP2 does not reshard after forward, so it stays gathered through backward;
    ``largest_block_unit_params`` the largest unit other than the root. ``None``: unknown, the
    largest unit stands for every gathered unit.
    """

    num_params: int
    num_trainable_params: int
    buffer_bytes: int = 0
    largest_unit_params: int = 0        # largest FSDP wrapping unit (all-gather buffer size)
    param_numels: tuple[int, ...] = ()  # trainable params, DDP bucket order; () if unknown
    largest_trainable_unit_params: int | None = None  # reduce-scatter buffer size; None: unknown
    root_unit_params: int | None = None              # FSDP root unit; None: unknown
    largest_block_unit_params: int | None = None     # largest non-root unit; None: unknown

    def __post_init__(self) -> None:
        if self.num_trainable_params > self.num_params:
            raise PlanInputError("num_trainable_params", f"cannot exceed num_params "
                                 f"({self.num_params})", value=self.num_trainable_params,
                                 fix="count only parameters with requires_grad=True, tied "
                                     "weights once")
        if self.largest_trainable_unit_params is not None and not (
                0 <= self.largest_trainable_unit_params <= self.num_trainable_params):
            raise PlanInputError("largest_trainable_unit_params",
                                 f"must be between 0 and num_trainable_params "
                                 f"({self.num_trainable_params})",
                                 value=self.largest_trainable_unit_params,
                                 fix="count the trainable parameters of the largest unit, or "
                                     "leave it None")
        for name in ("root_unit_params", "largest_block_unit_params"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.num_params:
                raise PlanInputError(name, f"must be between 0 and num_params "
                                     f"({self.num_params})", value=value,
                                     fix="count the parameters of that unit, or leave it None")


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes at the step's peak as a function of micro-batch: ``fixed + per_sample * b``.

    ``bytes_per_sample`` and ``fixed_bytes`` are for the precision the profile was made in
    (traced profiles: the dtype the model actually ran; analytic: from the precision given).
    The optimizer's temporaries are not part of a profile: the memory model computes them.
    ``includes_gradients``: the profile already holds the gradients alive at its peak (a trace
    sees them; the analytic transformer knows which exist), so the memory model adds none.
    ``gradient_bytes``: how many of the profile's bytes are those gradients (a trace's, taken
    without FSDP: unsharded; 0 when not known apart), so that the FSDP model can hold only what
    FSDP keeps alive instead (the unit reducing unsharded, the others as shards).
    """

    bytes_per_sample: float
    fixed_bytes: int = 0
    source: str = "analytic"            # "analytic" | "traced" | "given"
    notes: tuple[str, ...] = field(default_factory=tuple)
    includes_gradients: bool = False
    gradient_bytes: int = 0             # of fixed_bytes: the gradients at the peak (traced)

    def at(self, micro_batch: int) -> int:
        """Activation bytes at the peak for ``micro_batch`` samples."""
        return int(round(self.fixed_bytes + self.bytes_per_sample * micro_batch))
