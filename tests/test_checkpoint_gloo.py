"""Resume reads the checkpoint on rank 0 only (real gloo processes, no Ray).

Two ranks train a small MLP 2 steps, checkpoint (rank 0 writes), train 2 more (the reference).
A fresh wrap then resumes with :func:`load_train_state`, where rank 1 is handed a directory
that holds no checkpoint at all: it must receive model, optimizer and its own RNG state from
rank 0 by broadcast. Both ranks then train the same 2 steps and must reach the reference
parameters, for DDP, ZeRO-1 and FSDP2. A rank 0 that cannot read the file fails every rank.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from gloo_world import spawn

WORLD = 2
STRATEGIES = ("ddp", "zero1", "fsdp-full")


def _train(planned, optimizer, rank: int, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        torch.nn.functional.mse_loss(planned.module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _params(planned) -> list[list[float]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(planned.module, options=StateDictOptions(full_state_dict=True))
    return [state[k].flatten().tolist() for k in sorted(state)]


def _fresh(strategy: str):
    from raytrain_guard.runtime.model import wrap_model, wrap_optimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    planned = wrap_model(model, strategy=strategy, use_ray=False)
    return planned, wrap_optimizer(planned, torch.optim.AdamW(planned.module.parameters(),
                                                              lr=1e-2))


def _worker(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from raytrain_guard.errors import InputError
    from raytrain_guard.runtime.checkpoint import (gather_train_state, load_train_state,
                                                   write_train_state)

    out: dict = {}
    nowhere = os.path.join(out_dir, f"nothing-here-{rank}")
    for strategy in STRATEGIES:
        planned, optimizer = _fresh(strategy)
        _train(planned, optimizer, rank, 2)
        state = gather_train_state(planned, optimizer, step=2, loader_state={"epoch": 0},
                                   guard_state={"pace_delay_s": 0.1 * rank})
        ckpt = os.path.join(out_dir, f"ckpt-{strategy}")
        if rank == 0:
            write_train_state(ckpt, state)
        dist.barrier()
        drawn_after_save = torch.rand(1).item()
        _train(planned, optimizer, rank, 2)
        reference = _params(planned)

        fresh, fresh_opt = _fresh(strategy)
        head = load_train_state(ckpt if rank == 0 else nowhere, fresh, fresh_opt,
                                world_rank=rank)
        rng_back = torch.rand(1).item() == drawn_after_save
        _train(fresh, fresh_opt, rank, 2)
        got = _params(fresh)
        out[strategy] = {
            "equal": all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
                         for a, b in zip(got, reference)),
            "rng": rng_back, "step": head["step"], "guard": head["guard"],
            "no_model_in_head": "model" not in head and "optimizer" not in head}
    try:
        load_train_state(nowhere, *_fresh("ddp"), world_rank=rank)
        out["bad_file"] = "no error"
    except InputError as exc:
        out["bad_file"] = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


@pytest.mark.timeout(300)
def test_only_rank_0_reads_and_every_rank_resumes_exactly(tmp_path):
    spawn(_worker, WORLD, str(tmp_path))
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for strategy in STRATEGIES:
            assert got[strategy] == {"equal": True, "rng": True, "step": 2,
                                     "guard": [{"pace_delay_s": 0.0}, {"pace_delay_s": 0.1}],
                                     "no_model_in_head": True}, (rank, strategy, got[strategy])
        # rank 0 cannot read: the same error on both ranks, none left waiting
        assert got["bad_file"].startswith("checkpoint: has no train_state.pt"), got["bad_file"]


class _Payload:
    """Stands for anything a pickle could run on load."""


def test_a_one_file_checkpoint_loads_safely_or_not_at_all(tmp_path):
    from raytrain_guard.errors import InputError
    from raytrain_guard.runtime.checkpoint import FORMAT_VERSION, STATE_FILE, read_train_state

    torch.save({"format_version": FORMAT_VERSION, "step": 1, "x": _Payload()},
               tmp_path / STATE_FILE)
    with pytest.raises(InputError, match="objects a safe load refuses"):
        read_train_state(tmp_path)
    torch.save({"format_version": FORMAT_VERSION, "step": 1,
                "rng": [{"python": (3, (1, 2), None)}]},
               tmp_path / STATE_FILE)
    assert read_train_state(tmp_path)["step"] == 1
