"""Sharded checkpoints (torch.distributed.checkpoint) on real gloo processes, no Ray.

Two ranks train a small MLP 2 steps under FSDP2 and DDP and save with :func:`save_sharded`,
each rank into a directory of its own (as each Ray Train worker does; the directories are then
merged, as Ray merges the ranks' directories of one report). Resumed on 2 ranks, 2 more steps
reach the uninterrupted run's parameters exactly; resumed on 1 rank (a smaller world), the
model holds the saved parameters and the optimizer its saved state. No rank ever holds the
whole FSDP2 model while saving.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn


def _fresh(strategy: str):
    from raytrain_guard.runtime.model import wrap_model, wrap_optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    planned = wrap_model(model, strategy=strategy, use_ray=False)
    return planned, wrap_optimizer(planned, torch.optim.AdamW(planned.module.parameters(),
                                                              lr=1e-2))


def _train(planned, optimizer, rank: int, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        torch.nn.functional.mse_loss(planned.module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(planned) -> dict[str, list[float]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(planned.module, options=StateDictOptions(full_state_dict=True))
    return {k: v.flatten().tolist() for k, v in state.items()}


def _worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    from raytrain_guard.runtime.checkpoint import load_sharded, save_sharded

    result = {}
    for strategy in ("fsdp-full", "ddp"):
        planned, optimizer = _fresh(strategy)
        _train(planned, optimizer, rank, 2)
        own = os.path.join(out, strategy, f"rank{rank}")
        meta = save_sharded(own, planned, optimizer, step=2, loader_state={"epoch": 0},
                            guard_state={"pace_delay_s": 0.1 * rank}, loss=float(rank))
        saved = _full(planned)
        dist.barrier()
        merged = os.path.join(out, strategy, "merged")
        if rank == 0:
            for r in (0, 1):
                shutil.copytree(os.path.join(out, strategy, f"rank{r}"), merged,
                                dirs_exist_ok=True)
        dist.barrier()
        _train(planned, optimizer, rank, 2)
        reference = _full(planned)
        fresh, fresh_opt = _fresh(strategy)
        head = load_sharded(merged, fresh, fresh_opt, world_rank=rank)
        _train(fresh, fresh_opt, rank, 2)
        result[strategy] = {
            "resumed_equal": all(torch.allclose(torch.tensor(a), torch.tensor(reference[k]),
                                                atol=1e-6) for k, a in _full(fresh).items()),
            "step": head["step"], "losses": head["losses"], "guard": head["guard"],
            "local_shard_files": sorted(f for f in os.listdir(own) if f.endswith(".distcp")),
            "saved": saved, "meta_losses": meta["losses"]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


@pytest.mark.timeout(300)
def test_sharded_checkpoints_resume_exactly_on_the_same_and_a_smaller_world(tmp_path):
    from raytrain_guard.runtime.checkpoint import load_sharded

    spawn(_worker, 2, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        for strategy, got in result.items():
            assert got["resumed_equal"], (rank, strategy)
            assert got["step"] == 2 and got["losses"] == [0.0, 1.0] == got["meta_losses"]
            assert got["guard"] == [{"pace_delay_s": 0.0}, {"pace_delay_s": 0.1}]
    # FSDP2: each rank wrote its own shard file; DDP's replicated tensors once, by rank 0
    assert results[0]["fsdp-full"]["local_shard_files"] == ["__0_0.distcp"]
    assert results[1]["fsdp-full"]["local_shard_files"] == ["__1_0.distcp"]
    # a world of one (no process group here): the FSDP2 shards come back as whole tensors
    for strategy in ("fsdp-full", "ddp"):
        planned, optimizer = _fresh(strategy)
        head = load_sharded(tmp_path / strategy / "merged", planned, optimizer, world_rank=0)
        assert head["world_size"] == 2
        for k, v in planned.module.state_dict().items():
            torch.testing.assert_close(v.flatten(), torch.tensor(results[0][strategy]["saved"][k]))
        assert optimizer.state_dict()["state"], strategy        # the AdamW moments came back
