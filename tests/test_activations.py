"""Analytic transformer activations and parameter counts, exact values worked out by hand."""

from __future__ import annotations

import pytest

from raytrain_guard.core.activations import (AttentionKernel, Recompute, TransformerShape,
                                             analytic_transformer, layer_activation_bytes,
                                             transformer_activations, transformer_model_stats)
from raytrain_guard.core.memory_model import Precision, TrainingSetup, estimate
from raytrain_guard.errors import PlanInputError

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
    # flash: 16 sbh * 2 + fp32 logsumexp 4 * a s b = 4 * 4 * 32
    (False, "flash", "none", "bf16", 32 * 2048 + 512),
    # flash with dropout: + two 1-byte masks 2 sbh (flash regenerates its own mask)
    (True, "flash", "none", "bf16", 34 * 2048 + 512),
    # fp32 elements: 16 sbh * 4 + a s^2 b * 4
    (False, "math", "none", "fp32", 64 * 2048 + 4 * 4096),
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
    # kv width 64/4*2 = 32. elements: attention sbh*3 + 2*s*b*32 = 6144 + 2048 = 8192;
    # MLP sbh + 4*s*b*96 = 2048 + 12288 = 14336; norms 4096 -> 26624 * 2 bytes + lse 512
    assert layer_activation_bytes(shape, 1, Precision.BF16, AttentionKernel.FLASH,
                                  Recompute.NONE) == 26624 * 2 + 512


def test_profile_outside_the_layers_and_amp_weight_copies():
    shape = TransformerShape(**SMALL)
    prof = transformer_activations(shape, precision="amp-bf16", attention="flash")
    # per sample: 2 layers * (32*2048 + 512) + final norm s*h*2 = 4096
    #             + logits s*v*2 = 6400 + fp32 log-softmax 4*s*v = 12800 + fp32 dlogits 12800
    assert prof.bytes_per_sample == 2 * 66048 + 4096 + 6400 + 12800 + 12800
    # autocast bf16 weight copies: 2 * (2 layers * 12 h^2 + v h) = 2 * (98304 + 6400)
    assert prof.fixed_bytes == 2 * (2 * 12 * 64 * 64 + 100 * 64)
    assert prof.source == "analytic"
    assert transformer_activations(shape, precision="bf16").fixed_bytes == 0


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    shape = TransformerShape(**SMALL)
    prof = transformer_activations(shape, precision="bf16", recompute="full", attention="math")
    # 2 layers * sbh * 2 = 8192, one full math layer 32*2048 + 2*4096 = 73728, outside 36096
    assert prof.bytes_per_sample == 8192 + 73728 + 36096


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
    # 16 bytes per parameter / 64 ranks = 17.2 GB of state; activations dominate the rest
    assert est.breakdown["params"] + est.breakdown["optimizer"] == \
        -(-68976648192 // 64) * (2 + 12)
    assert est.peak_phase == "backward"


@pytest.mark.parametrize("kwargs,field", [
    (dict(SMALL, heads=5), "heads"),
    (dict(SMALL, layers=0), "layers"),
    (dict(SMALL, num_kv_heads=3), "num_kv_heads"),
])
def test_bad_shapes_name_the_field(kwargs, field):
    with pytest.raises(PlanInputError) as err:
        TransformerShape(**kwargs)
    assert err.value.field == field


def test_unknown_recompute_names_the_choices():
    with pytest.raises(PlanInputError, match="none, selective, full"):
        transformer_activations(TransformerShape(**SMALL), recompute="some")
