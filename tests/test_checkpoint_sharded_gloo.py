"""Sharded checkpoints (torch.distributed.checkpoint) on real gloo processes, no Ray.

Two ranks train a small MLP (three parameter groups with their own settings) 2 steps under
FSDP2, DDP and ZeRO-1 and save with :func:`save_sharded`, each rank into a directory of its own
(as each Ray Train worker does; the directories are then merged, as Ray merges the ranks'
directories of one report). Every step trains on one global batch, each rank its slice, so a run
on any world size takes the same steps. The uninterrupted run's 2 more steps are the reference:
resumed on 2 ranks, 2 more steps reach it exactly; resumed on 1 rank (a smaller world) and, for
ZeRO-1, on 3 ranks (another partition of the parameters), the optimizer state comes back exact
and 2 more steps reach the reference up to the order of the gradient sums. No rank ever holds
the whole FSDP2 model or the whole ZeRO-1 optimizer while saving.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn

STRATEGIES = ("fsdp-full", "ddp", "zero1")
GLOBAL_BATCH = 12          # a slice for every rank of a world of 1, 2 or 3


def _fresh(strategy: str):
    from raytrain_guard.runtime.dist.model import wrap_model, wrap_optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    planned = wrap_model(model, strategy=strategy, use_ray=False)
    p = dict(planned.inner.named_parameters())
    # three groups: ZeRO-1 partitions each apart, so on 3 ranks some rank owns none of a group
    groups = [{"params": [p["0.weight"], p["2.weight"]], "weight_decay": 0.1},
              {"params": [p["0.bias"], p["2.bias"], p["4.bias"]], "weight_decay": 0.0},
              {"params": [p["4.weight"]], "lr": 3e-3}]
    return planned, wrap_optimizer(planned, torch.optim.AdamW(groups, lr=1e-2))


def _train(planned, optimizer, rank: int, world: int, first: int, steps: int = 2) -> None:
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
        share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        torch.nn.functional.mse_loss(planned.module(x[share]), y[share]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(planned) -> dict[str, list[float]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(planned.module, options=StateDictOptions(full_state_dict=True))
    return {k: v.flatten().tolist() for k, v in state.items()}


def _local_state(planned, optimizer) -> dict[str, dict[str, list[float]]]:
    """The optimizer state this rank holds (ZeRO-1: its partition), by parameter name."""
    local = getattr(optimizer, "optim", optimizer)
    names = {p: n for n, p in planned.inner.named_parameters()}
    return {names[p]: {k: v.flatten().tolist() for k, v in s.items()}
            for p, s in local.state.items()}


def _settings(optimizer) -> list[dict]:
    return [{"lr": g["lr"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]


def _worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    from raytrain_guard.runtime.dist.checkpoint import load_sharded, save_sharded

    result = {}
    for strategy in STRATEGIES:
        planned, optimizer = _fresh(strategy)
        _train(planned, optimizer, rank, 2, first=0)
        optimizer.param_groups[2]["lr"] = 2e-3      # as a scheduler does: saved, restored
        own = os.path.join(out, strategy, f"rank{rank}")
        meta = save_sharded(own, planned, optimizer, step=2, loader_state={"epoch": 0},
                            guard_state={"pace_delay_s": 0.1 * rank}, loss=float(rank))
        saved = _full(planned)
        owned = sorted(_local_state(planned, optimizer)) if strategy == "zero1" else []
        dist.barrier()
        merged = os.path.join(out, strategy, "merged")
        if rank == 0:
            for r in (0, 1):
                shutil.copytree(os.path.join(out, strategy, f"rank{r}"), merged,
                                dirs_exist_ok=True)
        dist.barrier()
        _train(planned, optimizer, rank, 2, first=2)
        reference = _full(planned)
        fresh, fresh_opt = _fresh(strategy)
        head = load_sharded(merged, fresh, fresh_opt, world_rank=rank)
        _train(fresh, fresh_opt, rank, 2, first=2)
        result[strategy] = {
            "resumed": _full(fresh), "reference": reference, "owned": owned,
            "step": head["step"], "losses": head["losses"], "guard": head["guard"],
            "local_shard_files": sorted(f for f in os.listdir(own) if f.endswith(".distcp")),
            "saved": saved, "meta_losses": meta["losses"]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of the three strategies written on 2 ranks, and what each rank saw."""
    out = tmp_path_factory.mktemp("sharded")
    spawn(_worker, 2, str(out))
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _equal(got: dict[str, list[float]], want: dict[str, list[float]]) -> bool:
    return got.keys() == want.keys() and all(got[k] == want[k] for k in got)


def _close(got: dict[str, list[float]], want: dict[str, list[float]]) -> bool:
    # another world size sums the gradients in another order: float32 rounding only
    return got.keys() == want.keys() and all(
        torch.allclose(torch.tensor(got[k]), torch.tensor(want[k]), rtol=0, atol=1e-6)
        for k in got)


@pytest.mark.timeout(300)
def test_sharded_checkpoints_resume_exactly_on_the_same_world(saved):
    _, results = saved
    for rank, result in enumerate(results):
        for strategy, got in result.items():
            assert _equal(got["resumed"], got["reference"]), (rank, strategy)
            assert got["step"] == 2 and got["losses"] == [0.0, 1.0] == got["meta_losses"]
            assert got["guard"] == [{"pace_delay_s": 0.0}, {"pace_delay_s": 0.1}]
    # FSDP2: each rank wrote its own shard file
    assert results[0]["fsdp-full"]["local_shard_files"] == ["__0_0.distcp"]
    assert results[1]["fsdp-full"]["local_shard_files"] == ["__1_0.distcp"]


@pytest.mark.timeout(120)
def test_a_world_of_one_resumes_every_strategy(saved):
    from sharded_reader import read_sharded

    from raytrain_guard.runtime.dist.checkpoint import load_sharded

    out, results = saved
    for strategy in STRATEGIES:
        directory = out / strategy / "merged"
        whole = read_sharded(directory)
        # no process group: a plain model and AdamW (ZeRO-1's partitions read by name)
        planned, optimizer = _fresh(strategy)
        assert type(optimizer).__name__ == "AdamW"
        head = load_sharded(directory, planned, optimizer, world_rank=0)
        assert head["world_size"] == 2 and head["strategy"] == strategy
        for k, v in planned.module.state_dict().items():
            assert v.flatten().tolist() == results[0][strategy]["saved"][k], (strategy, k)
        for name, state in _local_state(planned, optimizer).items():
            for key, value in state.items():
                assert value == whole["optimizer"][f"state.{name}.{key}"].flatten().tolist()
        assert _settings(optimizer) == [{"lr": 1e-2, "weight_decay": 0.1},
                                        {"lr": 1e-2, "weight_decay": 0.0},
                                        {"lr": 2e-3, "weight_decay": 1e-2}]
        _train(planned, optimizer, 0, 1, first=2)
        assert _close(_full(planned), results[0][strategy]["reference"]), strategy


@pytest.mark.timeout(60)
def test_zero1_writes_each_partition_on_the_rank_that_owns_it(saved):
    from torch.distributed.checkpoint import FileSystemReader

    from raytrain_guard.planner.host_account import checkpoint_shard
    from raytrain_guard.planner.memory_model import TrainingSetup
    from raytrain_guard.planner.model_stats import ModelStats
    from raytrain_guard.runtime.dist.checkpoint import META_FILE

    out, results = saved
    owned = [results[r]["zero1"]["owned"] for r in (0, 1)]
    assert owned[0] and owned[1] and not set(owned[0]) & set(owned[1])
    metadata = FileSystemReader(str(out / "zero1" / "merged")).read_metadata()
    files = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    for rank in (0, 1):
        for name in owned[rank]:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert files[f"optimizer.state.{name}.{key}"] == f"__{rank}_0.distcp"
    # rank 0's meta file holds the run's small state only: no optimizer
    meta = torch.load(out / "zero1" / "merged" / META_FILE, weights_only=True)
    assert set(meta) == {"format_version", "step", "world_size", "strategy",
                         "optimizer_layout", "loader", "rng", "guard", "losses", "extra"}
    # what each rank wrote is within the planner's checkpoint staging (DDP: DCP de-duplicates
    # the replicas, so a rank writes less than the whole model state)
    model = ModelStats(num_params=433, num_trainable_params=433,
                       param_numels=(128, 16, 256, 16, 16, 1))
    for strategy in ("ddp", "zero1"):
        written = _tensor_bytes_per_file(out / strategy / "merged")
        planned = checkpoint_shard(model, TrainingSetup(strategy=strategy, optimizer="adamw",
                                                        world_size=2)).bytes
        assert max(written.values()) <= planned, (strategy, written, planned)
        assert max(written.values()) < 433 * 12, strategy   # less than the whole state


def _tensor_bytes_per_file(directory) -> dict[str, int]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    out: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        item = metadata.state_dict_metadata[index.fqn]
        if isinstance(item, TensorStorageMetadata):
            chunk = next(c for c in item.chunks if torch.Size(c.offsets) == index.offset)
            size = torch.empty((), dtype=item.properties.dtype).element_size()
            out[info.relative_path] = out.get(info.relative_path, 0) + chunk.sizes.numel() * size
    return out


def _resume_on_three(rank: int, directory: str, out: str) -> None:
    from raytrain_guard.runtime.dist.checkpoint import load_sharded

    planned, optimizer = _fresh("zero1")
    load_sharded(directory, planned, optimizer, world_rank=rank)
    loaded, settings = _local_state(planned, optimizer), _settings(optimizer)
    local_groups = [len(g["params"]) for g in optimizer.optim.param_groups]
    _train(planned, optimizer, rank, 3, first=2)
    with open(os.path.join(out, f"three{rank}.json"), "w") as fh:
        json.dump({"loaded": loaded, "settings": settings, "local_groups": local_groups,
                   "resumed": _full(planned)}, fh)


@pytest.mark.timeout(300)
def test_zero1_resumes_on_a_larger_world_with_another_partition(saved):
    from sharded_reader import read_sharded

    out, results = saved
    directory = out / "zero1" / "merged"
    spawn(_resume_on_three, 3, str(directory), str(out))
    ranks = [json.loads((out / f"three{r}.json").read_text()) for r in range(3)]
    whole = read_sharded(directory)["optimizer"]
    # every parameter is owned by exactly one of the 3 ranks, with its saved state exactly
    owners = [name for r in ranks for name in r["loaded"]]
    assert sorted(owners) == sorted(results[0]["zero1"]["owned"] + results[1]["zero1"]["owned"])
    for r in ranks:
        for name, state in r["loaded"].items():
            for key, value in state.items():
                assert value == whole[f"state.{name}.{key}"].flatten().tolist()
        assert r["settings"] == [{"lr": 1e-2, "weight_decay": 0.1},
                                 {"lr": 1e-2, "weight_decay": 0.0},
                                 {"lr": 2e-3, "weight_decay": 1e-2}]
    assert any(0 in r["local_groups"] for r in ranks)    # a rank owns none of some group
    assert [r["loaded"] for r in ranks] != [{}] * 3
    for r in ranks:
        assert _close(r["resumed"], results[0]["zero1"]["reference"])
