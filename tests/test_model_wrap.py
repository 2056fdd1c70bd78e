"""Planned DDP / FSDP2 / ZeRO-1 and the loop's checkpoint, on a real 2-rank gloo process group.

One spawn of two processes runs every distributed check (start-up dominates: ~8 s); each rank
writes what it saw to JSON and the tests below assert on it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from gloo_world import one_rank, spawn

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError
from raytrain_guard.planner.buckets import recommend_bucket_cap
from raytrain_guard.planner.memory_model import Strategy
from raytrain_guard.runtime.dist.model import KIND_LOCAL, parse_strategy, wrap_model

WORLD = 2
LAYER = 256
NUM_LAYERS = 8
# Gradient bytes of the bucket model: 8 x (256 x 256 weight + 256 bias) x 4 bytes
# = 8 x 263168 = 2105344.
GRAD_BYTES = NUM_LAYERS * (LAYER * LAYER + LAYER) * 4
# DDP buckets in reverse registration order: bias (1024 B), weight (262144 B), bias, ...
PARAM_BYTES = [b for _ in range(NUM_LAYERS) for b in (LAYER * 4, LAYER * LAYER * 4)]


def _bucket_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(NUM_LAYERS)])


def _mlp() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _gpt() -> torch.nn.Module:
    """A transformer as people write it: blocks in a ModuleList, tied embedding and head."""
    from examples.models import TinyGPT
    torch.manual_seed(2)
    return TinyGPT(vocab=64, hidden=32, heads=2, layers=2, max_seq=16)


def _train_gpt(planned, optimizer, rank: int, steps: int) -> list[float]:
    from examples.models import gpt_loss
    gen = torch.Generator().manual_seed(200 + rank)
    losses = []
    for _ in range(steps):
        loss = gpt_loss(planned.module, torch.randint(0, 64, (4, 16), generator=gen))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _grouped_adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    """Two groups with their own settings: weights (decayed) and biases (no decay, half lr)."""
    named = list(module.named_parameters())
    return torch.optim.AdamW([
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.5},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
         "lr": 0.005}], lr=0.05)


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 16, generator=gen), torch.randn(4, 1, generator=gen))
            for _ in range(n)]


def _train(planned, optimizer, rank: int, *, steps: int, grad_accum: int,
           between=None) -> list[float]:
    losses = []
    data = _batches(rank, steps * grad_accum)
    for step in range(steps):
        for micro in range(grad_accum):
            x, y = data[step * grad_accum + micro]
            with planned.grad_sync(micro == grad_accum - 1):
                loss = torch.nn.functional.mse_loss(planned.module(x), y) / grad_accum
                loss.backward()
            losses.append(float(loss))
            if between is not None and micro < grad_accum - 1:
                between()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _full_params(planned) -> list[list[float]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(planned.module, options=StateDictOptions(full_state_dict=True))
    return [state[k].flatten().tolist() for k in sorted(state)]


def _worker(rank: int, out_dir: str) -> None:
    from raytrain_guard.runtime.dist.checkpoint import load_sharded, save_sharded
    from raytrain_guard.runtime.dist.model import wrap_optimizer
    out: dict = {}

    # 1. The planner's cap, applied: DDP builds the buckets the plan predicted.
    config = GuardConfig(min_bucket_cap_mb=0.0625, target_num_buckets=8)
    plan = recommend_bucket_cap(grad_bytes=GRAD_BYTES, config=config, param_bytes=PARAM_BYTES)
    for name, cap in (("planned", plan.bucket_cap_mb), ("quarter", 0.25), ("default", None)):
        planned = wrap_model(_bucket_model(), strategy="ddp", bucket_cap_mb=cap, use_ray=False)
        for _ in range(3):     # buckets are rebuilt after the first iteration
            planned.module(torch.randn(4, LAYER)).sum().backward()
        out[name] = planned.bucket_layout()
    out["plan"] = plan.to_dict()

    # 2. no_sync: without sync the ranks' gradients differ (different data); with it they agree.
    planned = wrap_model(_mlp(), strategy="ddp", use_ray=False)
    x, y = _batches(rank, 1)[0]
    with planned.grad_sync(False):
        torch.nn.functional.mse_loss(planned.module(x), y).backward()
    unsynced = planned.inner[0].weight.grad.clone()
    planned.inner.zero_grad()
    with planned.grad_sync(True):
        torch.nn.functional.mse_loss(planned.module(x), y).backward()
    synced = planned.inner[0].weight.grad.clone()
    both = [torch.zeros_like(unsynced) for _ in range(WORLD)]
    dist.all_gather(both, unsynced)
    out["unsynced_equal"] = bool(torch.equal(both[0], both[1]))
    dist.all_gather(both, synced)
    out["synced_equal"] = bool(torch.allclose(both[0], both[1]))

    # 3. DDP, ZeRO-1, FSDP2 (both modes): same data, same init, 3 steps x 2 micro-batches.
    for strategy in ("ddp", "zero1", "fsdp-full", "fsdp-grad-op"):
        planned = wrap_model(_mlp(), strategy=strategy, use_ray=False)
        optimizer = wrap_optimizer(planned, torch.optim.SGD(planned.module.parameters(), lr=0.1,
                                                            momentum=0.9))
        losses = _train(planned, optimizer, rank, steps=3, grad_accum=2)
        out[strategy] = {"kind": planned.kind, "losses": losses, "params": _full_params(planned),
                         "optimizer": type(optimizer).__name__}

        # 4. Checkpoint round trip: save after 3 steps, train 2 more (reference); restore into
        #    a fresh wrap, train the same 2 steps: same parameters.
        ckpt_dir = os.path.join(out_dir, f"ckpt-{strategy}")
        save_sharded(ckpt_dir, planned, optimizer, step=3, loader_state={"epoch": 0},
                     guard_state={"rank": rank})
        dist.barrier()
        drawn_after_save = torch.rand(1).item()   # the RNG state saved must come back
        _train(planned, optimizer, rank, steps=2, grad_accum=1)
        reference = _full_params(planned)

        fresh = wrap_model(_mlp(), strategy=strategy, use_ray=False)
        fresh_opt = wrap_optimizer(fresh, torch.optim.SGD(fresh.module.parameters(), lr=0.1,
                                                          momentum=0.9))
        torch.manual_seed(1000 + rank)            # another state: the checkpoint's comes back
        loaded = load_sharded(ckpt_dir, fresh, fresh_opt, world_rank=rank)
        out[strategy]["rng_restored"] = torch.rand(1).item() == drawn_after_save
        _train(fresh, fresh_opt, rank, steps=2, grad_accum=1)
        out[strategy]["resumed_equal"] = _close(_full_params(fresh), reference)
        out[strategy]["guard_states"] = loaded["guard"]
        out[strategy]["step"] = loaded["step"]
    # 5. FSDP2 through wrap_model on a transformer whose blocks sit in a ModuleList (fully_shard
    #    rejects the ModuleList itself): same parameters as DDP after 3 AdamW steps.
    for strategy in ("ddp", "fsdp-full", "fsdp-grad-op"):
        planned = wrap_model(_gpt(), strategy=strategy, use_ray=False)
        optimizer = torch.optim.AdamW(planned.module.parameters(), lr=1e-2)
        out[f"gpt-{strategy}"] = {"losses": _train_gpt(planned, optimizer, rank, steps=3),
                                  "params": _full_params(planned), **planned.applied}

    # 6. ZeRO-1 keeps the parameter groups (their own lr and weight decay): same parameters as
    #    DDP with the same grouped AdamW.
    for strategy in ("ddp", "zero1"):
        planned = wrap_model(_mlp(), strategy=strategy, use_ray=False)
        optimizer = wrap_optimizer(planned, _grouped_adamw(planned.module))
        _train(planned, optimizer, rank, steps=3, grad_accum=1)
        out[f"groups-{strategy}"] = {
            "params": _full_params(planned), "optimizer": type(optimizer).__name__,
            "groups": [[len(g["params"]), g["lr"], g["weight_decay"]]
                       for g in optimizer.param_groups]}

    # 7. FSDP2 gradient sync under accumulation (3 steps x 2 micro-batches, as in 3): between
    #    micro-batches every_micro_batch holds sharded gradients (DTensor local shards) and
    #    last_micro_batch none on the shards, the unsharded ones on FSDP's gathered parameters.
    for strategy in ("fsdp-full", "fsdp-grad-op"):
        for sync in ("every_micro_batch", "last_micro_batch"):
            planned = wrap_model(_mlp(), strategy=strategy, use_ray=False, fsdp_grad_sync=sync)
            optimizer = torch.optim.SGD(planned.module.parameters(), lr=0.1, momentum=0.9)
            seen: list[dict] = []
            _train(planned, optimizer, rank, steps=3, grad_accum=2,
                   between=lambda seen=seen, m=planned.module: seen.append(_grad_layout(m)))
            out[f"sync-{strategy}-{sync}"] = {"params": _full_params(planned), "seen": seen,
                                              **planned.describe()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


def _grad_layout(module) -> dict:
    """Elements of gradient this rank holds: on the sharded parameters (DTensor local shards)
    and on FSDP2's unsharded parameters (its private ``FSDPParam._unsharded_param``: where the
    gradients of a micro-batch without sync wait)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    sharded = [p.grad for p in module.parameters() if p.grad is not None]
    unsharded = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                full = getattr(fsdp_param, "_unsharded_param", None)
                grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                if grad is None and full is not None:
                    grad = full.grad
                unsharded += grad.numel() if grad is not None else 0
    return {"sharded": sum(g.to_local().numel() for g in sharded),
            "all_dtensor": all(isinstance(g, DTensor) for g in sharded),
            "unsharded": unsharded,
            "full": sum(p.numel() for p in module.parameters())}


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-6) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("wrap")
    spawn(_worker, WORLD, str(out_dir))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_planned_bucket_cap_is_what_ddp_builds(ranks):
    # Plan: 2105344 B / 8 buckets = 263168 B = 0.2510 MiB, rounded up to 1/16 MiB -> 0.3125 MiB
    # = 327680 B. One layer (263168 B) stays under it, two layers (526336 B) pass it: 4 buckets.
    layout = ranks[0]["planned"]
    assert ranks[0]["plan"]["bucket_cap_mb"] == 0.3125
    assert layout["bucket_cap_bytes"] == 327680
    assert layout["has_rebuilt_buckets"]
    assert layout["bucket_sizes"] == [526336] * 4
    assert layout["num_buckets"] == ranks[0]["plan"]["num_buckets"] == 4


def test_bucket_cap_changes_the_layout(ranks):
    # 0.25 MiB = 262144 B: bias 1024 + weight 262144 = 263168 >= cap closes each bucket: 8.
    assert ranks[0]["quarter"]["bucket_sizes"] == [263168] * 8
    # Default 25 MiB, but DDP's first bucket is 1 MiB: 4 layers = 1052672 >= 1048576 close it,
    # the other 4 layers share the second bucket.
    assert ranks[0]["default"]["bucket_cap_bytes"] == 25 * 1024 * 1024
    assert ranks[0]["default"]["bucket_sizes"] == [1052672, 1052672]


def test_grad_sync_false_skips_the_allreduce(ranks):
    assert ranks[0]["unsynced_equal"] is False
    assert ranks[0]["synced_equal"] is True


@pytest.mark.parametrize("strategy", ["zero1", "fsdp-full", "fsdp-grad-op"])
def test_sharded_strategies_train_like_ddp(ranks, strategy):
    for rank in ranks:
        assert rank[strategy]["kind"] == ("ddp" if strategy == "zero1" else "fsdp2")
        assert _close(rank[strategy]["params"], rank["ddp"]["params"])
        assert rank[strategy]["losses"] == pytest.approx(rank["ddp"]["losses"], abs=1e-6)
    assert ranks[0]["zero1"]["optimizer"] == "ZeroRedundancyOptimizer"
    # every rank ends with the same full parameters
    assert _close(ranks[0][strategy]["params"], ranks[1][strategy]["params"])


@pytest.mark.parametrize("strategy", ["fsdp-full", "fsdp-grad-op"])
def test_fsdp2_shards_a_transformer_per_block_like_ddp(ranks, strategy):
    for rank in ranks:
        got = rank[f"gpt-{strategy}"]
        # the two blocks of the ModuleList are units (the planner's wrap_units), then the root
        assert got["fsdp_units"] == 2 + 1
        assert _close(got["params"], rank["gpt-ddp"]["params"])
        assert got["losses"] == pytest.approx(rank["gpt-ddp"]["losses"], abs=1e-5)
    assert _close(ranks[0][f"gpt-{strategy}"]["params"], ranks[1][f"gpt-{strategy}"]["params"])


def test_zero1_keeps_parameter_groups(ranks):
    for rank in ranks:
        assert rank["groups-zero1"]["optimizer"] == "ZeroRedundancyOptimizer"
        # 3 weights decayed at lr 0.05, 3 biases undecayed at lr 0.005, as the user grouped them
        assert rank["groups-zero1"]["groups"] == rank["groups-ddp"]["groups"] \
            == [[3, 0.05, 0.5], [3, 0.005, 0.0]]
        assert _close(rank["groups-zero1"]["params"], rank["groups-ddp"]["params"])


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp-full", "fsdp-grad-op"])
def test_checkpoint_resumes_exactly(ranks, strategy):
    for rank in ranks:
        assert rank[strategy]["resumed_equal"] is True
        assert rank[strategy]["step"] == 3
        assert rank[strategy]["rng_restored"] is True
        assert rank[strategy]["guard_states"] == [{"rank": 0}, {"rank": 1}]


def test_single_process_is_not_wrapped():
    planned = wrap_model(torch.nn.Linear(2, 2), strategy="ddp", use_ray=False, device="cpu")
    assert planned.kind == KIND_LOCAL
    assert planned.bucket_layout() == {}
    with planned.grad_sync(False):
        planned.module(torch.ones(1, 2)).sum().backward()


@pytest.mark.parametrize("answer", [
    lambda: "bucket_sizes=80",                       # not a mapping
    lambda: {"bucket_sizes": [80]},                  # sizes not as comma-separated text
    lambda: {"bucket_sizes": "80,abc"},              # text that is not bytes
    lambda: (_ for _ in ()).throw(RuntimeError("reducer gone")),     # it raises
], ids=["text", "list", "garbage", "raises"])
def test_bucket_layout_fails_open_on_changed_ddp_logging_data(tmp_path, monkeypatch, caplog,
                                                             answer):
    """DDP's private logging data answering in another shape: the layout holds the cap only,
    warned once, and the end of the run goes on."""
    from raytrain_guard import log
    from raytrain_guard.runtime.dist import model as model_module
    from raytrain_guard.runtime.dist.model import KIND_DDP, PlannedModel

    monkeypatch.setattr(log, "_SAID", set())
    layouts = []

    def body():
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        planned = PlannedModel(ddp, ddp.module, Strategy.DDP, KIND_DDP)
        layouts.append(planned.bucket_layout())     # torch's own answer: 80 bytes, one bucket
        monkeypatch.setattr(ddp, "_get_ddp_logging_data", answer)
        layouts.extend(planned.bucket_layout() for _ in range(2))

    with caplog.at_level("WARNING", logger=model_module.__name__):
        one_rank(body, str(tmp_path))
    assert layouts[0]["bucket_sizes"] == [80]        # 4 x 4 weight + 4 bias, 4 bytes each
    cap_only = {"bucket_cap_bytes": 25 * 1024 * 1024, "gradient_as_bucket_view": False}
    assert layouts[1:] == [cap_only, cap_only]
    warned = [r.message for r in caplog.records if r.name == model_module.__name__]
    assert len(warned) == 1 and "_get_ddp_logging_data" in warned[0], warned


@pytest.mark.parametrize("text,expected", [
    ("ddp", Strategy.DDP), ("ZeRO1", Strategy.ZERO1), ("fsdp_full", Strategy.FSDP_FULL),
    ("fsdp", Strategy.FSDP_FULL), ("fsdp-grad-op", Strategy.FSDP_GRAD_OP),
])
def test_parse_strategy(text, expected):
    assert parse_strategy(text) is expected


def test_bad_inputs_name_the_field():
    with pytest.raises(InputError, match="strategy: unknown parallel strategy.*'horovod'"):
        parse_strategy("horovod")
    with pytest.raises(InputError, match="bucket_cap_mb: must be > 0"):
        wrap_model(torch.nn.Linear(2, 2), bucket_cap_mb=0, use_ray=False)
    with pytest.raises(InputError, match="model: is not a torch.nn.Module"):
        wrap_model(object(), use_ray=False)


@pytest.mark.parametrize("strategy", ["fsdp-full", "fsdp-grad-op"])
def test_fsdp_grad_sync_modes(ranks, strategy):
    # the MLP: 16*32+32 + 32*32+32 + 32+1 = 1633 parameters; each rank's shards hold about half
    for rank in ranks:
        every = rank[f"sync-{strategy}-every_micro_batch"]
        last = rank[f"sync-{strategy}-last_micro_batch"]
        assert (every["fsdp_grad_sync"], last["fsdp_grad_sync"]) == \
            ("every_micro_batch", "last_micro_batch")
        assert len(every["seen"]) == len(last["seen"]) == 3     # once per step, between
        for seen in every["seen"]:   # reduce-scattered: sharded gradients, nothing unsharded
            assert seen["all_dtensor"] and seen["unsharded"] == 0
            assert 0 < seen["sharded"] < seen["full"] == 1633
        for seen in last["seen"]:    # held unsharded: the whole model's, none on the shards
            assert seen["sharded"] == 0 and seen["unsharded"] == seen["full"] == 1633
        # same data, same init: both modes end at the same weights, and at DDP's
        assert _close(every["params"], last["params"])
        assert _close(every["params"], rank["ddp"]["params"])


def test_wrap_model_refuses_auto_grad_sync():
    with pytest.raises(InputError, match="fsdp_grad_sync.*Plan.fsdp_grad_sync"):
        wrap_model(torch.nn.Linear(2, 2), strategy="fsdp-full", use_ray=False,
                   fsdp_grad_sync="auto")
