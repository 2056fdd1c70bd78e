"""Analytic transformer activations and parameter counts, exact values worked out by hand."""

from __future__ import annotations

import pytest

from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.activations import (
    AttentionKernel,
    Recompute,
    TransformerShape,
    analytic_transformer,
    layer_activation_bytes,
    transformer_activations,
    transformer_model_stats,
)
from raytrain_guard.planner.memory_model import Precision, TrainingSetup, estimate

# s = 32, h = 64, a = 4, b = 1: sbh = 2048, a s^2 b = 4096
SMALL = dict(layers=2, hidden=64, heads=4, seq_len=32, vocab=100)

LAYER = [
    # dropout, kernel, recompute, precision, bytes per layer
    # Korthikanti: 34 sbh + 5 a s^2 b = 69632 + 20480
    (True, "math", "none", "bf16", 34 * 2048 + 5 * 4096),
    # selective recompute drops the s^2 terms: 34 sbh
    (True, "math", "selective", "bf16", 34 * 2048),
    # no dropout, math: 16 sbh elements * 2 bytes + softmax output a s^2 b * 2
    (False, "math", "none", "bf16", 32 * 2048 + 2 * 4096),
    # flash: 16 sbh * 2 (its output, in (b, s, a, d) layout, is the projection's input: no
    # contiguous copy) + fp32 logsumexp 4 * a s b = 4 * 4 * 32
    (False, "flash", "none", "bf16", 32 * 2048 + 512),
    # flash with dropout: + two 1-byte masks 2 sbh (flash regenerates its own mask)
    (True, "flash", "none", "bf16", 34 * 2048 + 512),
    # fp32 elements: 16 sbh * 4 + a s^2 b * 4
    (False, "math", "none", "fp32", 64 * 2048 + 4 * 4096),
    # per-op SAC, f = 4h = 256, no gate: matmuls Q, K, V, O, fc1, fc2 -> saved Q, V, fc1 =
    # (64 + 64 + 256) * 32 * 2 bytes = 12 sbh; block input 2 sbh; SDPA output 2 sbh + lse 512
    (False, "flash", "per-op", "bf16", 16 * 2048 + 512),
    # per-op with the math kernel: SDPA's math path is made of ops off the save list
    (False, "math", "per-op", "bf16", 14 * 2048),
    # full: the block input only, 2 sbh
    (False, "flash", "full", "bf16", 2 * 2048),
]


@pytest.mark.parametrize("dropout,kernel,recompute,precision,expected", LAYER)
def test_layer_bytes(dropout, kernel, recompute, precision, expected):
    shape = TransformerShape(dropout=dropout, **SMALL)
    got = layer_activation_bytes(shape, 1, Precision(precision), AttentionKernel(kernel),
                                 Recompute(recompute))
    assert got == expected


def test_layer_bytes_are_linear_in_micro_batch():
    shape = TransformerShape(**SMALL)
    one = layer_activation_bytes(shape, 1, Precision.BF16, AttentionKernel.MATH, Recompute.NONE)
    assert layer_activation_bytes(shape, 5, Precision.BF16, AttentionKernel.MATH,
                                  Recompute.NONE) == 5 * one


def test_gated_mlp_and_grouped_query_attention():
    shape = TransformerShape(layers=1, hidden=64, heads=4, seq_len=32, vocab=100,
                             ffn_hidden=96, num_kv_heads=2, gated_mlp=True, bias=False)
    # no bias -> RMSNorm: each norm an fp32 copy 4 sbh + the normalised bf16 tensor 2 sbh:
    # 2 * 6 * 2048 = 24576; attention input, Q, projection input (= SDPA output), MLP input
    # 4 * 2 sbh = 16384; K and V expanded to the 4 query heads (repeat_kv) 2 * 2 sbh = 8192;
    # lse 4 * 4 * 32 = 512; gated MLP 4 * 2 * 32 * 96 = 24576 -> 74240
    assert layer_activation_bytes(shape, 1, Precision.BF16, AttentionKernel.FLASH,
                                  Recompute.NONE) == 74240
    # with enable_gqa (no expansion) K and V keep their width 32: 2 * 2 * 32 * 32 = 4096
    narrow = TransformerShape(layers=1, hidden=64, heads=4, seq_len=32, vocab=100,
                              ffn_hidden=96, num_kv_heads=2, gated_mlp=True, bias=False,
                              expand_kv=False)
    assert layer_activation_bytes(narrow, 1, Precision.BF16, AttentionKernel.FLASH,
                                  Recompute.NONE) == 74240 - 8192 + 4096


def test_profile_outside_the_layers_and_amp_weight_copies():
    shape = TransformerShape(**SMALL)
    prof = transformer_activations(shape, precision="amp-bf16", attention="flash")
    # amp: residual stream fp32 (r = 4), matmul outputs bf16 (e = 2). Per layer: LayerNorms
    # 2 * 4 * 2048 = 16384; attention input, Q, K, V, projection input, MLP input 6 * 4096;
    # MLP 2 * 2 * 32 * 256 = 32768; lse 512 -> 74240.
    # per sample: 2 layers 148480 + final norm 4 * 2048 + head input 2 * 2048 = 12288
    #             + loss 12 * s * v = 38400 (fp32 log-probs, NLL grad, log-softmax grad)
    assert prof.bytes_per_sample == 2 * 74240 + 12288 + 38400
    # autocast bf16 weight copies: 2 * (2 layers * 12 h^2 + v h) = 2 * (98304 + 6400)
    assert prof.fixed_bytes == 2 * (2 * 12 * 64 * 64 + 100 * 64)
    assert prof.source == "analytic"
    assert transformer_activations(shape, precision="bf16").fixed_bytes == 0


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    shape = TransformerShape(**SMALL)
    prof = transformer_activations(shape, precision="bf16", recompute="full", attention="math")
    # 2 layers * sbh * 2 = 8192; final norm + head input 2 * 4096 = 8192; then the larger of
    # the loss (12 * 32 * 100 = 38400) and one rebuilt math layer (32*2048 + 2*4096 = 73728)
    assert prof.bytes_per_sample == 8192 + 8192 + 73728
    # at that moment the output head's bf16 gradient exists: v h * 2 = 100 * 64 * 2
    assert prof.fixed_bytes == 12800 and prof.includes_gradients


# parameter counts of published shapes
COUNTS = [
    # GPT-2 small without its 1024 x 768 position table: 12 (12 h^2 + 13 h) + V h + 2 h
    #   = 12 * 7087872 + 38597376 + 1536 = 123653376 (+ 786432 positions = 124439808, GPT-2's)
    (dict(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257, tied_embeddings=True),
     123653376),
    # Llama-2-70B: 80 x (h(h + 2*1024) + h^2 + 3 h 28672 + 2h) + 2 V h + h = 68976648192
    (dict(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000, ffn_hidden=28672,
          num_kv_heads=8, gated_mlp=True, bias=False), 68976648192),
]


@pytest.mark.parametrize("shape,params", COUNTS)
def test_published_parameter_counts(shape, params):
    stats = transformer_model_stats(TransformerShape(**shape))
    assert stats.num_params == params
    assert stats.num_trainable_params == params


def test_analytic_entry_point_feeds_estimate():
    stats, prof = analytic_transformer(layers=80, hidden=8192, heads=64, seq_len=4096,
                                       vocab=32000, ffn_hidden=28672, num_kv_heads=8,
                                       gated_mlp=True, bias=False, precision="bf16-master",
                                       recompute="full")
    est = estimate(stats, prof, TrainingSetup(strategy="fsdp-full", precision="bf16-master",
                                              world_size=64, micro_batch=1))
    # 16 bytes per parameter / 64 ranks = 17.2 GB of state; activations dominate the rest.
    # Under FSDP bf16-master the fp32 shard is the master (4 bytes) and Adam holds 2 x 4
    assert est.breakdown["params"] + est.breakdown["optimizer"] == \
        -(-68976648192 // 64) * (4 + 8)
    # with full recompute the activations are small (6.9 GiB a sample): the end of backward,
    # with every fp32 gradient shard (4.0 GiB) and two reduce-scatter buffers of a block in
    # fp32 (2 x 855654400 x 4 bytes = 6.4 GiB), is the peak (25.0 GiB against 23.6 GiB).
    # Gathered there: the root and one block in bf16, the one prefetched; the block reducing
    # was resharded first (FSDP2's post_backward), so not two blocks as before
    assert est.peak_phase == "late-backward"
    assert est.breakdown["comm"] == (524296192 + 855654400) * 2 + 2 * 855654400 * 4


@pytest.mark.parametrize("kwargs,field", [
    (dict(SMALL, heads=5), "heads"),
    (dict(SMALL, layers=0), "layers"),
    (dict(SMALL, num_kv_heads=3), "num_kv_heads"),
    (dict(SMALL, num_kv_heads=0), "num_kv_heads"),
    (dict(SMALL, num_kv_heads=2.0), "num_kv_heads"),    # 4 % 2.0 == 0, but a float kv_dim
    (dict(SMALL, ffn_hidden=256.0), "ffn_hidden"),
    (dict(SMALL, vocab=True), "vocab"),
])
def test_bad_shapes_name_the_field(kwargs, field):
    with pytest.raises(PlanInputError) as err:
        TransformerShape(**kwargs)
    assert err.value.field == field


def test_unknown_recompute_names_the_choices():
    with pytest.raises(PlanInputError, match="none, selective, per-op, full"):
        transformer_activations(TransformerShape(**SMALL), recompute="some")


# Llama 3.1 8B as torchtitan trains it (benchmarks/planner_published.py): h 4096, 32 layers,
# 32 heads, 8 KV heads (k = 1024), f 14336, vocab 128256, seq 8192, bf16 under FSDP2
LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, seq_len=8192, vocab=128256,
                 ffn_hidden=14336, num_kv_heads=8, gated_mlp=True, bias=False)


def test_llama3_8b_parameters_and_fsdp_units():
    stats = transformer_model_stats(TransformerShape(**LLAMA3_8B))
    # block: 2 h^2 (Q, O) + 2 h k (K, V) + 3 h f + 2 h (norms) = 33554432 + 8388608
    #        + 176160768 + 8192 = 218112000; root: 2 v h + h = 1050673152 + 4096
    assert stats.largest_block_unit_params == 218112000
    assert stats.root_unit_params == 1050677248
    assert stats.num_params == 32 * 218112000 + 1050677248 == 8030261248


def test_per_op_recompute_of_llama3_8b():
    shape = TransformerShape(**LLAMA3_8B)
    prof = transformer_activations(shape, precision="bf16-master", recompute="per-op")
    # per token and block: input 2 h = 8192; matmuls Q, K, V, O, gate, up, down -> saved Q (h),
    # V (k), gate (f), down (h): 2 * (4096 + 1024 + 14336 + 4096) = 47104; SDPA output 2 h =
    # 8192 + lse 4 a = 128 -> 63616 bytes; 32 blocks x 8192 tokens = 16676552704
    # final RMSNorm (4 + 2) h + head input 2 h = 32768 per token -> 268435456
    # loss 12 * 8192 * 128256 = 12608077824; a rebuilt block (213120 - 36992 reused per token
    # = 1442840576) is smaller, so the peak is the loss's moment
    assert prof.bytes_per_sample == 16676552704 + 268435456 + 12608077824
    assert prof.fixed_bytes == 0                   # no gradient exists at the loss's moment
    assert any("per-op SAC" in n for n in prof.notes)


def test_per_op_peak_is_a_rebuilt_block_when_the_vocabulary_is_small():
    shape = TransformerShape(layers=2, hidden=64, heads=4, seq_len=32, vocab=8, bias=False,
                             gated_mlp=True, ffn_hidden=96)
    prof = transformer_activations(shape, precision="bf16", recompute="per-op")
    # saved per block: input 4096 + matmuls Q, V, gate, down (64+64+96+64) * 64 = 18432 +
    # SDPA 4096 + 512 = 27136; final 6 * 2048 + 4096 = 16384; loss 12 * 32 * 8 = 3072;
    # a rebuilt block: 74240 (see above, k = h here: same) - reused SDPA 4608 - gate 6144
    assert prof.bytes_per_sample == 2 * 27136 + 16384 + (74240 - 4608 - 6144)
    assert prof.fixed_bytes == 8 * 64 * 2          # the head's gradient, v h in bf16
