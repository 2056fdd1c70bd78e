"""Analytic activations of a decoder transformer in eager PyTorch (pure: standard library only).

Counts the tensors autograd saves for backward, per layer (norms, attention by kernel, MLP,
dropout masks) and outside the layers (final norm, output head, the loss's fp32 ``t x v``
tensors), under each recompute mode, from the shape a model card gives
(:class:`TransformerShape`). The formulas, where they come from (Korthikanti et al., traces of
real models) and the peak under recompute: docs/memory_model.md. When in doubt, trace the model
(:mod:`raytrain_guard.planner.trace`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from raytrain_guard.errors import PlanInputError, check_int
from raytrain_guard.planner.memory_model import PARAM_BYTES, Precision, coerce_enum
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"    # Megatron's: only the seq x seq attention terms are recomputed
    PER_OP = "per-op"          # PyTorch per-op SAC: every other matmul and SDPA saved
    FULL = "full"


class AttentionKernel(str, enum.Enum):
    FLASH = "flash"    # fused kernel: no seq x seq tensor kept
    MATH = "math"      # eager softmax(QK^T)V: keeps the seq x seq probabilities


class Norm(str, enum.Enum):
    LAYERNORM = "layernorm"    # fused native_layer_norm: saves its input
    RMSNORM = "rmsnorm"        # eager Llama-style RMSNorm: an fp32 copy + the normalised tensor


#: bytes of one activation element per precision
ACTIVATION_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 2, Precision.BF16_MASTER: 2,
                    Precision.BF16: 2}
#: bytes of one residual-stream element: autocast leaves the embedding output in fp32 and every
#: residual add promotes to it, so the stream between blocks is fp32 under amp-bf16
RESIDUAL_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 4, Precision.BF16_MASTER: 2,
                  Precision.BF16: 2}
#: the loss at the start of backward: three fp32 t x v tensors (log-probabilities, the NLL
#: gradient, the log-softmax gradient), 4 bytes each
LOSS_BYTES_PER_LOGIT = 12
#: what the per-op policy says, for the plan's notes
PER_OP_POLICY = ("per-op SAC (torchtitan's policy): saves each block's input, the outputs of "
                 "its 1st, 3rd, 5th ... matmul (Q, V, gate/fc1, down for a gated MLP) and of "
                 "SDPA; recomputes the rest, one block at a time in backward")


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A decoder-only transformer, described the way model cards describe it.

    ``ffn_hidden`` defaults to ``4 * hidden``; ``num_kv_heads`` to ``heads`` (no grouped-query
    attention); ``gated_mlp`` is a SwiGLU MLP (three matrices, as in Llama); ``bias`` adds the
    linear biases of GPT-2-style blocks; ``tied_embeddings`` shares the input embedding with the
    output head (counted once). ``norm`` defaults to LayerNorm with ``bias`` and RMSNorm without
    (Llama). ``expand_kv``: grouped-query K and V are expanded to every head before attention
    (``repeat_kv``, as Llama code does); False when SDPA is called with ``enable_gqa=True``.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int | None = None
    num_kv_heads: int | None = None
    gated_mlp: bool = False
    bias: bool = True
    tied_embeddings: bool = False
    dropout: bool = False
    norm: Norm | None = None
    expand_kv: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            check_int(name, getattr(self, name), at_least=1, error=PlanInputError,
                      fix=f"pass --{name.replace('_', '-')} as a whole number >= 1")
        if self.num_kv_heads is not None:
            check_int("num_kv_heads", self.num_kv_heads, at_least=1, error=PlanInputError,
                      fix="omit it for one per head (no grouped-query attention)")
        if self.ffn_hidden is not None:
            check_int("ffn_hidden", self.ffn_hidden, at_least=1, error=PlanInputError,
                      fix="omit it for 4 x hidden")
        if self.hidden % self.heads:
            raise PlanInputError("heads", f"must divide hidden={self.hidden}", value=self.heads,
                                 fix="choose a head count that divides the hidden size")
        if self.heads % self.kv_heads:
            raise PlanInputError("num_kv_heads", f"must divide heads={self.heads}",
                                 value=self.kv_heads,
                                 fix="choose a key/value head count that divides the heads")
        norm = self.norm if self.norm is not None else (
            Norm.LAYERNORM if self.bias else Norm.RMSNORM)
        object.__setattr__(self, "norm", coerce_enum(Norm, norm, "norm"))

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.heads

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def attention_kv_dim(self) -> int:
        """Width of the K and V that attention saves: every head's when they are expanded."""
        return self.hidden if self.expand_kv else self.kv_dim

    def block_matmul_params(self) -> int:
        """Weights of one block's matrices: Q, K, V, output projection and the MLP."""
        h, k, f = self.hidden, self.kv_dim, self.ffn
        return h * h + 2 * h * k + h * h + (3 if self.gated_mlp else 2) * h * f

    def block_params(self) -> int:
        """All parameters of one block: matrices, biases (if any) and two norms (weight+bias
        for LayerNorm when ``bias``, weight only otherwise)."""
        h, k, f = self.hidden, self.kv_dim, self.ffn
        biases = (h + 2 * k + h + (2 if self.gated_mlp else 1) * f + h) if self.bias else 0
        norms = 4 * h if self.bias else 2 * h
        return self.block_matmul_params() + biases + norms

    def root_params(self) -> int:
        """Parameters outside the blocks: embedding, output head (once if tied), final norm:
        FSDP's root unit."""
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else embed
        final_norm = 2 * self.hidden if self.bias else self.hidden
        return embed + head + final_norm


def transformer_model_stats(shape: TransformerShape) -> ModelStats:
    """Parameter counts of ``shape``: blocks, embedding, output head (once if tied), final norm.

    FSDP units: one per block, and the root (embedding, head, final norm), which FSDP2 keeps
    gathered from forward to the end of backward. ``param_numels`` is left empty (the analytic
    model does not know the registration order).
    """
    block, root = shape.block_params(), shape.root_params()
    total = shape.layers * block + root
    return ModelStats(num_params=total, num_trainable_params=total,
                      largest_unit_params=max(block, root), root_unit_params=root,
                      largest_block_unit_params=block)


def _norm_bytes(shape: TransformerShape, precision: Precision) -> int:
    """Bytes one norm saves per hidden element: LayerNorm ``r``, eager RMSNorm ``4 + r``."""
    r = RESIDUAL_BYTES[precision]
    return 4 + r if shape.norm is Norm.RMSNORM else r


def layer_parts(shape: TransformerShape, micro_batch: int, precision: Precision,
                attention: AttentionKernel) -> dict[str, int]:
    """Bytes one layer saves for backward without recompute, by tensor
    (docs/memory_model.md)."""
    s, b, h, a, f = shape.seq_len, micro_batch, shape.hidden, shape.heads, shape.ffn
    t = s * b
    e = ACTIVATION_BYTES[precision]
    parts = {
        "norms": 2 * _norm_bytes(shape, precision) * t * h,
        "attention_in": e * t * h,
        "q": e * t * h,
        "kv": 2 * e * t * shape.attention_kv_dim,
        "proj_in": e * t * h,   # math: contiguous copy; flash: the kernel's own output
        "mlp_in": e * t * h,
        "mlp": (4 if shape.gated_mlp else 2) * e * t * f,
    }
    if attention is AttentionKernel.FLASH:
        parts["attention_lse"] = 4 * a * t               # fp32 logsumexp
    else:
        parts["scores"] = e * a * s * s * b              # softmax output
    if shape.dropout:
        parts["dropout_masks"] = 2 * t * h
        if attention is AttentionKernel.MATH:
            parts["scores_dropout"] = (1 + e) * a * s * s * b
    return parts


def layer_activation_bytes(shape: TransformerShape, micro_batch: int, precision: Precision,
                           attention: AttentionKernel, recompute: Recompute) -> int:
    """Bytes one layer keeps for backward while the other layers run: everything without
    recompute; the ``s^2`` terms dropped under ``selective``; the block input and the
    saved outputs under ``per-op``; the block input under ``full``."""
    parts = layer_parts(shape, micro_batch, precision, attention)
    if recompute is Recompute.NONE:
        return sum(parts.values())
    if recompute is Recompute.SELECTIVE:
        return sum(v for k, v in parts.items() if k not in ("scores", "scores_dropout"))
    t = shape.seq_len * micro_batch
    block_input = RESIDUAL_BYTES[precision] * t * shape.hidden
    if recompute is Recompute.FULL:
        return block_input
    return block_input + sum(per_op_saved(shape, micro_batch, precision, attention).values())


def per_op_saved(shape: TransformerShape, micro_batch: int, precision: Precision,
                 attention: AttentionKernel) -> dict[str, int]:
    """Outputs one block keeps under per-op SAC besides its input: the odd-numbered matmuls
    (Q, V, and the 5th, 7th ...) and SDPA's outputs (flash kernel; the math path is made of
    ops outside the save list)."""
    t = shape.seq_len * micro_batch
    e = ACTIVATION_BYTES[precision]
    h, k, f = shape.hidden, shape.kv_dim, shape.ffn
    # matmul outputs in block order; every other one is saved, starting with the first
    widths = [h, k, k, h] + ([f, f, h] if shape.gated_mlp else [f, h])
    saved = {"matmul_outputs": e * t * sum(widths[0::2])}
    if attention is AttentionKernel.FLASH:
        saved["attention_out"] = e * t * h + 4 * shape.heads * t
    return saved


def _outside_layers(shape: TransformerShape, precision: Precision) -> tuple[int, int]:
    """(final norm + head input, loss tensors) per sample at the start of backward."""
    s, h = shape.seq_len, shape.hidden
    e = ACTIVATION_BYTES[precision]
    final = _norm_bytes(shape, precision) * s * h + e * s * h
    return final, LOSS_BYTES_PER_LOGIT * s * shape.vocab


def transformer_activations(shape: TransformerShape, *, precision: Precision | str = "amp-bf16",
                            recompute: Recompute | str = "none",
                            attention: AttentionKernel | str = "flash") -> ActivationProfile:
    """Activation bytes at the backward peak, ``fixed + per_sample * micro_batch``."""
    precision = coerce_enum(Precision, precision, "precision")
    recompute = coerce_enum(Recompute, recompute, "recompute")
    attention = coerce_enum(AttentionKernel, attention, "attention")
    s, h, v = shape.seq_len, shape.hidden, shape.vocab
    kept = shape.layers * layer_activation_bytes(shape, 1, precision, attention, recompute)
    fixed = 0
    final, loss = _outside_layers(shape, precision)
    notes = [(f"analytic transformer (eager): {shape.layers} layers, hidden {h}, seq {s}, "
              f"{shape.norm.value}, {attention.value} attention, recompute {recompute.value}; "
              f"loss {LOSS_BYTES_PER_LOGIT} x seq x vocab bytes per sample (fp32 "
              f"log-probabilities and two gradients; logits dropped before backward)")]
    if recompute in (Recompute.FULL, Recompute.PER_OP):
        rebuilt = sum(layer_parts(shape, 1, precision, attention).values())
        if recompute is Recompute.PER_OP:
            # the rebuilt block reuses the saved SDPA output (its projection input and lse)
            reused = per_op_saved(shape, 1, precision, attention).get("attention_out", 0)
            reused += ACTIVATION_BYTES[precision] * s * shape.ffn   # gate/fc1 output
            rebuilt -= reused
            notes.append(PER_OP_POLICY)
        per_sample = kept + final + max(loss, rebuilt)
        if rebuilt > loss:   # the rebuilt block's moment: the output head's gradient exists
            fixed += PARAM_BYTES[precision] * v * h
            notes.append("peak while the last block is rebuilt in backward: the output "
                         "head's gradient is alive")
    else:
        per_sample = kept + final + loss
    if shape.num_kv_heads not in (None, shape.heads):
        notes.append("grouped-query K/V " + ("expanded to every head (repeat_kv)"
                                             if shape.expand_kv else
                                             "kept at their own width (enable_gqa)"))
    if precision is Precision.AMP_BF16:
        fixed += 2 * (shape.layers * shape.block_matmul_params() + v * h)
        notes.append("amp-bf16: bf16 copies of the matmul weights kept by autocast")
    return ActivationProfile(bytes_per_sample=float(per_sample), fixed_bytes=fixed,
                             source="analytic", notes=tuple(notes), includes_gradients=True)


def analytic_transformer(*, layers: int, hidden: int, heads: int, seq_len: int, vocab: int,
                         precision: Precision | str = "amp-bf16",
                         recompute: Recompute | str = "none",
                         attention: AttentionKernel | str = "flash",
                         **shape_options) -> tuple[ModelStats, ActivationProfile]:
    """The CLI's entry point for ``--layers/--hidden/--heads/--seq-len/--vocab``.

    ``shape_options`` are the other :class:`TransformerShape` fields (``ffn_hidden``,
    ``num_kv_heads``, ``gated_mlp``, ``bias``, ``tied_embeddings``, ``dropout``, ``norm``,
    ``expand_kv``).
    """
    shape = TransformerShape(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                             vocab=vocab, **shape_options)
    return (transformer_model_stats(shape),
            transformer_activations(shape, precision=precision, recompute=recompute,
                                    attention=attention))
