"""Analytic activations of a decoder transformer (pure: standard library only).

Counts the tensors autograd saves for backward, per layer, after Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models"). With ``s`` sequence length,
``b`` micro-batch, ``h`` hidden size, ``a`` heads, ``f`` MLP hidden size (``4h`` by default),
``k`` the key/value width (``h`` unless grouped-query attention), ``e`` bytes of one activation
element (4 in fp32, 2 under bf16 autocast or in bf16) saved tensors per layer are, in elements:

* attention: its input ``sbh``, Q ``sbh``, K and V ``2sbk``, the input of the output projection
  ``sbh``; the ``math`` kernel also keeps the softmax output ``as^2b``; the ``flash`` kernel
  keeps instead a logsumexp ``asb`` in fp32;
* MLP: its input ``sbh``, then ``2sbf`` (fc1 output and GeLU output) or ``4sbf`` for a gated MLP
  (gate, up, activation and their product);
* two LayerNorm/RMSNorm inputs ``2sbh``;
* with dropout, 1-byte masks: ``sbh`` after attention, ``sbh`` after the MLP, and with the math
  kernel ``as^2b`` for the attention probabilities plus their dropped-out copy (``as^2b``
  elements) that feeds ``attn @ V``.

For ``f = 4h``, ``k = h``, math kernel and dropout this is ``34sbh + 5as^2b`` bytes in 16-bit:
Korthikanti's formula. Recompute ``selective`` drops the ``s^2`` terms (the attention core is
recomputed); ``full`` keeps only each layer's input (``sbh``) plus one layer's activations,
rebuilt during its backward. Outside the layers: the final norm input ``sbh``, the logits
``sbv`` (``e`` bytes) and the fp32 log-softmax of the loss ``4sbv``; early in backward the
fp32 gradient of the logits ``4sbv`` is alive too (this is where the peak usually is).

Under ``amp-bf16`` autocast keeps a bf16 copy of every matmul weight alive until its backward:
``2 x (matmul parameters)`` bytes, independent of the batch (``fixed_bytes``).

The formula describes Megatron-style kernels; CPU SDPA with dropout 0 takes the flash path.
When in doubt, trace the model (``raytrain_guard.trace``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from raytrain_guard.core.memory_model import Precision, coerce_enum
from raytrain_guard.core.model_stats import ActivationProfile, ModelStats
from raytrain_guard.errors import PlanInputError


class Recompute(str, enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class AttentionKernel(str, enum.Enum):
    FLASH = "flash"    # fused kernel: no seq x seq tensor kept
    MATH = "math"      # eager softmax(QK^T)V: keeps the seq x seq probabilities


#: bytes of one activation element per precision
ACTIVATION_BYTES = {Precision.FP32: 4, Precision.AMP_BF16: 2, Precision.BF16_MASTER: 2,
                    Precision.BF16: 2}


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A decoder-only transformer, described the way model cards describe it.

    ``ffn_hidden`` defaults to ``4 * hidden``; ``num_kv_heads`` to ``heads`` (no grouped-query
    attention); ``gated_mlp`` is a SwiGLU MLP (three matrices, as in Llama); ``bias`` adds the
    linear biases of GPT-2-style blocks; ``tied_embeddings`` shares the input embedding with the
    output head (counted once).
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

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanInputError(name, "must be a positive integer", value=value,
                                     fix=f"pass --{name.replace('_', '-')} as a whole number >= 1")
        if self.hidden % self.heads:
            raise PlanInputError("heads", f"must divide hidden={self.hidden}", value=self.heads,
                                 fix="choose a head count that divides the hidden size")
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.heads
        if kv < 1 or self.heads % kv:
            raise PlanInputError("num_kv_heads", f"must divide heads={self.heads}", value=kv,
                                 fix="choose a key/value head count that divides the heads")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise PlanInputError("ffn_hidden", "must be a positive integer",
                                 value=self.ffn_hidden, fix="omit it for 4 x hidden")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.heads
        return self.hidden // self.heads * kv

    def block_matmul_params(self) -> int:
        """Weights of one block's matrices: Q, K, V, output projection and the MLP."""
        h, k, f = self.hidden, self.kv_dim, self.ffn
        return h * h + 2 * h * k + h * h + (3 if self.gated_mlp else 2) * h * f

    def block_params(self) -> int:
        """All parameters of one block: matrices, biases (if any) and two norms (weight+bias
        for LayerNorm when ``bias``, weight only for RMSNorm)."""
        h, k, f = self.hidden, self.kv_dim, self.ffn
        biases = (h + 2 * k + h + (2 if self.gated_mlp else 1) * f + h) if self.bias else 0
        norms = 4 * h if self.bias else 2 * h
        return self.block_matmul_params() + biases + norms


def transformer_model_stats(shape: TransformerShape) -> ModelStats:
    """Parameter counts of ``shape``: blocks, embedding, output head (once if tied), final norm.

    The largest FSDP unit is one block, or the embedding when it is larger; ``param_numels`` is
    left empty (the analytic model does not know the registration order).
    """
    block = shape.block_params()
    embed = shape.vocab * shape.hidden
    head = 0 if shape.tied_embeddings else embed
    final_norm = 2 * shape.hidden if shape.bias else shape.hidden
    total = shape.layers * block + embed + head + final_norm
    return ModelStats(num_params=total, num_trainable_params=total,
                      largest_unit_params=max(block, embed))


def layer_activation_bytes(shape: TransformerShape, micro_batch: int, precision: Precision,
                           attention: AttentionKernel, recompute: Recompute) -> int:
    """Bytes one layer keeps for backward (without recompute), see the module docstring."""
    s, b, h, a = shape.seq_len, micro_batch, shape.hidden, shape.heads
    e = ACTIVATION_BYTES[Precision(precision)]
    sbh = s * b * h
    elems = sbh + sbh + 2 * s * b * shape.kv_dim + sbh           # attention in, Q, K, V, proj in
    elems += sbh + (4 if shape.gated_mlp else 2) * s * b * shape.ffn  # MLP
    elems += 2 * sbh                                              # two norms
    total = elems * e
    quadratic = 0
    if attention is AttentionKernel.MATH:
        quadratic = a * s * s * b * e + (a * s * s * b * (1 + e) if shape.dropout else 0)
    else:
        total += a * s * b * 4                                    # fp32 logsumexp
    if shape.dropout:
        total += 2 * sbh                                          # two 1-byte masks
    if recompute is Recompute.NONE:
        total += quadratic
    return total


def transformer_activations(shape: TransformerShape, *, precision: Precision | str = "amp-bf16",
                            recompute: Recompute | str = "none",
                            attention: AttentionKernel | str = "flash") -> ActivationProfile:
    """Activation bytes at the backward peak, ``fixed + per_sample * micro_batch``."""
    precision = coerce_enum(Precision, precision, "precision")
    recompute = coerce_enum(Recompute, recompute, "recompute")
    attention = coerce_enum(AttentionKernel, attention, "attention")
    e = ACTIVATION_BYTES[precision]
    s, h, v = shape.seq_len, shape.hidden, shape.vocab
    layer = layer_activation_bytes(shape, 1, precision, attention, recompute)
    if recompute is Recompute.FULL:
        # every layer keeps its input; one layer at a time is rebuilt in its backward
        layer_full = layer_activation_bytes(shape, 1, precision, attention, Recompute.NONE)
        per_sample = shape.layers * s * h * e + layer_full
    else:
        per_sample = shape.layers * layer
    per_sample += s * h * e + s * v * e + 4 * s * v + 4 * s * v   # norm, logits, log-softmax, dlogits
    fixed = 0
    notes = [f"analytic transformer: {shape.layers} layers, hidden {h}, seq {s}, "
             f"{attention.value} attention, recompute {recompute.value}"]
    if precision is Precision.AMP_BF16:
        fixed = 2 * (shape.layers * shape.block_matmul_params() + v * h)
        notes.append("amp-bf16: bf16 copies of the matmul weights kept by autocast")
    return ActivationProfile(bytes_per_sample=float(per_sample), fixed_bytes=fixed,
                             source="analytic", notes=tuple(notes))


def analytic_transformer(*, layers: int, hidden: int, heads: int, seq_len: int, vocab: int,
                         precision: Precision | str = "amp-bf16",
                         recompute: Recompute | str = "none",
                         attention: AttentionKernel | str = "flash",
                         **shape_options) -> tuple[ModelStats, ActivationProfile]:
    """The CLI's entry point for ``--layers/--hidden/--heads/--seq-len/--vocab``.

    ``shape_options`` are the other :class:`TransformerShape` fields (``ffn_hidden``,
    ``num_kv_heads``, ``gated_mlp``, ``bias``, ``tied_embeddings``, ``dropout``).
    """
    shape = TransformerShape(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len,
                             vocab=vocab, **shape_options)
    return (transformer_model_stats(shape),
            transformer_activations(shape, precision=precision, recompute=recompute,
                                    attention=attention))

