"""A trace says how many of its activation bytes are gradients (``ActivationProfile.
gradient_bytes``), so the FSDP model can hold them as FSDP does (the unit reducing unsharded,
the rest as shards) instead of as the unsharded trace saw them."""

from __future__ import annotations

from examples import models
from raytrain_guard.planner.trace import trace_model


def test_mlp_trace_separates_its_gradients():
    # the MLP peaks in backward with the last two layers' gradients written: 131,328 + 524,800
    # parameters x 4 B = 2,624,512 B of gradients, inside the profile's fixed bytes
    traced = trace_model(models.mlp, models.mlp_batch, optimizer="adamw")
    acts = traced.activations
    assert acts.gradient_bytes == (131_328 + 524_800) * 4
    assert acts.gradient_bytes <= acts.fixed_bytes


def test_forward_peak_holds_no_gradient():
    # the frozen backbone's fine-tune peaks at the end of forward: no gradient exists yet
    traced = trace_model(models.finetune, models.finetune_batch, optimizer="adamw")
    assert traced.activations.gradient_bytes == 0
