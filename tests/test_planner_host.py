"""The planner's host account: the bytes a checkpoint stages per rank, by strategy, and a node's
staging plus prefetch against the host watermark (exact bytes worked out in the comments)."""

import pytest

from raytrain_guard import plan
from raytrain_guard.config import GuardConfig
from raytrain_guard.planner.host_account import checkpoint_shard, host_account
from raytrain_guard.planner.memory_model import TrainingSetup
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats

# 1 M trainable parameters in three tensors, AdamW (2 states), 4 ranks.
MODEL = ModelStats(num_params=1_000_000, num_trainable_params=1_000_000,
                   param_numels=(600_000, 300_000, 100_000))


@pytest.mark.parametrize("strategy, precision, expected", [
    # fp32: parameters 4 B, AdamW states 2 x 4 B. Whole model state 4 MB + 8 MB = 12 MB, held by
    # every rank; DCP writes each tensor once, to the least loaded rank: at most 12 MB / 4 plus
    # the largest tensor (600 000 x 4 B) = 3 MB + 2.4 MB
    ("ddp", "fp32", 5_400_000),
    # parameters replicated: 4 MB / 4 + 2.4 MB; ZeRO-1's partition (largest first to the least
    # loaded rank: 600 000 | 300 000 | 100 000 | 0): 600 000 x 8 B = 4.8 MB
    ("zero1", "fp32", 8_200_000),
    # shards: 250 000 x 4 B + 250 000 x 8 B
    ("fsdp-full", "fp32", 3_000_000),
    ("fsdp-grad-op", "fp32", 3_000_000),
    # bf16-master under DDP: bf16 parameters 2 MB + (fp32 master 4 B + 2 x 4 B) x 1 M = 14 MB
    # / 4 = 3.5 MB, largest tensor 600 000 x 4 B (a state or the master copy) = 2.4 MB
    ("ddp", "bf16-master", 5_900_000),
    # FSDP's shards are the fp32 master weights: 4 + 8 B a parameter, as fp32
    ("fsdp-full", "bf16-master", 3_000_000),
])
def test_checkpoint_shard_by_strategy(strategy, precision, expected):
    setup = TrainingSetup(strategy=strategy, precision=precision, optimizer="adamw",
                          world_size=4)
    assert checkpoint_shard(MODEL, setup).bytes == expected


def test_one_rank_writes_everything_and_unknown_sizes_split_evenly():
    one = TrainingSetup(strategy="ddp", optimizer="adamw", world_size=1)
    assert checkpoint_shard(MODEL, one).bytes == 12_000_000
    bare = ModelStats(num_params=1_000_000, num_trainable_params=1_000_000, buffer_bytes=40_000)
    ddp = TrainingSetup(strategy="ddp", optimizer="adamw", world_size=4)
    shard = checkpoint_shard(bare, ddp)
    assert shard.bytes == (12_000_000 + 40_000) // 4 and "even split" in shard.reason
    # FSDP2 leaves buffers replicated: de-duplicated like DDP's tensors
    fsdp = TrainingSetup(strategy="fsdp-full", optimizer="adamw", world_size=4)
    assert checkpoint_shard(bare, fsdp).bytes == 3_000_000 + 10_000


def test_host_account_adds_staging_to_the_prefetch_budget_per_node():
    # 200 MB host, 4 GPUs: prefetch 5 % / 4 = 2.5 MB per GPU; limit 90 % = 180 MB
    setup = TrainingSetup(strategy="ddp", optimizer="adamw", world_size=4)
    account = host_account(model=MODEL, setup=setup, host_memory_bytes=200_000_000,
                           gpus_per_node=4, config=GuardConfig())
    assert (account.checkpoint_staging_bytes, account.prefetch_bytes) == (5_400_000, 2_500_000)
    assert (account.node_bytes, account.limit_bytes) == ((5_400_000 + 2_500_000) * 4,
                                                         180_000_000)
    assert account.fits and "within" in account.arithmetic
    # a loader planned over its budget counts with its own bytes
    over = host_account(model=MODEL, setup=setup, host_memory_bytes=200_000_000,
                        gpus_per_node=4, config=GuardConfig(), loader_host_bytes=3_000_000)
    assert over.prefetch_bytes == 3_000_000


# 10 M parameters (6 M, 3 M, 1 M), AdamW fp32, 4 ranks on one node with 200 MB of RAM.
BIG = ModelStats(num_params=10_000_000, num_trainable_params=10_000_000,
                 param_numels=(6_000_000, 3_000_000, 1_000_000))


def _plan(strategy: str):
    setup = TrainingSetup(strategy=strategy, optimizer="adamw", world_size=4, micro_batch=1)
    return plan(model=BIG, activations=ActivationProfile(bytes_per_sample=1_000_000.0,
                                                          source="given"),
                setup=setup, device_memory_bytes=80_000_000_000,
                host_memory_bytes=200_000_000, cpus_per_node=8, gpus_per_node=4,
                batch_bytes=1000)


def test_a_plan_that_no_longer_fits_the_host_because_of_checkpoint_staging():
    # DDP: 120 MB of model state / 4 + the largest tensor 24 MB = 54 MB per GPU; with the
    # prefetch budget (2.5 MB) x 4 GPUs = 226 MB, over 180 MB (90 % of 200 MB); the prefetch
    # alone (10 MB) would fit
    ddp = _plan("ddp")
    d = ddp.to_dict()
    assert d["fits"]                                  # the card: plenty
    assert d["checkpoint_staging_bytes"] == 54_000_000
    assert d["host"]["node_bytes"] == 226_000_000 and not d["host"]["fits"]
    assert any(w.startswith("host memory: checkpoint staging") for w in d["warnings"])
    assert any(n.startswith("host: checkpoint staging") for n in d["notes"])
    # sharded (fsdp-full): 30 MB per GPU, (30 + 2.5) x 4 = 130 MB: fits, no warning
    fsdp = _plan("fsdp-full").to_dict()
    assert fsdp["checkpoint_staging_bytes"] == 30_000_000
    assert fsdp["host"]["fits"] and not any("host memory" in w for w in fsdp["warnings"])


def test_no_host_account_without_host_memory():
    setup = TrainingSetup(strategy="ddp", optimizer="adamw", world_size=4)
    p = plan(model=MODEL, activations=ActivationProfile(bytes_per_sample=0.0, source="given"),
             setup=setup, device_memory_bytes=80_000_000_000, host_memory_bytes=None,
             cpus_per_node=None)
    assert p.host is None and p.to_dict()["checkpoint_staging_bytes"] is None
