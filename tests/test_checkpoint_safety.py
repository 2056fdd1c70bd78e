"""What a sharded checkpoint does when its meta or torch's private helpers misbehave.

* The meta file is checked to load with ``weights_only=True`` when it is saved: an entry a
  resume could not read fails the save, naming the entry, and nothing is written.
* A meta file that cannot be read (torn, truncated, unsafe) is an InputError naming the file.
* Without torch's private ``_get_fqns`` (or with one that answers in another shape) the
  parameter names come from the module path: the same names for a plain and a DDP-wrapped
  module, so a ZeRO-1 save and resume go on, warned once.

No process group, or a one-rank gloo group in this process.
"""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")

from gloo_world import one_rank

from raytrain_guard import log
from raytrain_guard.errors import InputError
from raytrain_guard.planner.memory_model import Strategy
from raytrain_guard.runtime.dist import zero_state
from raytrain_guard.runtime.dist.checkpoint import META_FILE, load_sharded, read_meta, save_sharded
from raytrain_guard.runtime.dist.model import KIND_DDP, PlannedModel, wrap_model, wrap_optimizer


class Tokenizer:
    """Something a user might put in ``extra``: a class a weights_only load refuses."""


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                               torch.nn.Sequential(torch.nn.Linear(8, 1)))


def _local():
    planned = wrap_model(_mlp(), strategy="ddp", use_ray=False, device="cpu")
    return planned, torch.optim.AdamW(planned.module.parameters(), lr=1e-2)


def _step(planned, optimizer) -> None:
    planned.module(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_meta_that_would_not_load_fails_the_save_naming_the_entry(tmp_path):
    planned, optimizer = _local()
    _step(planned, optimizer)
    with pytest.raises(InputError, match=r"^extra\.tokenizer: would make train_meta\.pt "
                                         r"unreadable.*Unsupported global.*Tokenizer"):
        save_sharded(tmp_path / "ckpt", planned, optimizer, step=1, loader_state={},
                     guard_state=None, extra={"tokenizer": Tokenizer(), "note": "ok"})
    assert not (tmp_path / "ckpt").exists()          # refused before any shard was written
    with pytest.raises(InputError, match=r"^extra\.batch\.hook: would make train_meta\.pt"):
        save_sharded(tmp_path / "ckpt", planned, optimizer, step=1, loader_state={},
                     guard_state=None, extra={"batch": {"hook": lambda: 0}})   # not picklable
    assert not (tmp_path / "ckpt").exists()
    # plain data saves, and loads back with weights_only=True
    save_sharded(tmp_path / "ok", planned, optimizer, step=1, loader_state={"epoch": 0},
                 guard_state=None, extra={"note": "ok", "sizes": [1, 2.5]})
    assert read_meta(tmp_path / "ok")["extra"] == {"note": "ok", "sizes": [1, 2.5]}


def test_an_unreadable_meta_is_an_input_error_naming_the_file(tmp_path):
    planned, optimizer = _local()
    save_sharded(tmp_path / "ckpt", planned, optimizer, step=1, loader_state={},
                 guard_state=None)
    path = tmp_path / "ckpt" / META_FILE
    whole = path.read_bytes()
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"format_version": 3, "x": Tokenizer()}, unsafe)
    for content in (whole[: len(whole) // 2], b"", unsafe.read_bytes()):   # torn, empty, unsafe
        path.write_bytes(content)
        with pytest.raises(InputError, match="checkpoint: train_meta.pt cannot be read") as err:
            load_sharded(tmp_path / "ckpt", *_local(), world_rank=0)
        assert err.value.value == os.path.join(tmp_path / "ckpt", META_FILE)


def _names_without_get_fqns(monkeypatch, module) -> dict[str, str]:
    """Parameter name -> checkpoint name with torch's ``_get_fqns`` removed from torch."""
    from torch.distributed.checkpoint import state_dict
    with monkeypatch.context() as patch:
        patch.delattr(state_dict, "_get_fqns")
        return _by_name(module, zero_state.param_names(module))


def _by_name(module, names) -> dict[str, str]:
    return {n: names[p] for n, p in module.named_parameters()}


def test_names_without_get_fqns_match_torchs_for_plain_and_ddp_modules(tmp_path, monkeypatch,
                                                                       caplog):
    monkeypatch.setattr(log, "_SAID", set())
    caplog.set_level(logging.WARNING, logger=zero_state.__name__)
    plain = _mlp()
    want = {"0.weight": "0.weight", "0.bias": "0.bias",
            "2.0.weight": "2.0.weight", "2.0.bias": "2.0.bias"}
    assert _by_name(plain, zero_state.param_names(plain)) == want
    assert _names_without_get_fqns(monkeypatch, plain) == want

    def body():
        wrapped = torch.nn.parallel.DistributedDataParallel(_mlp())
        prefixed = {f"module.{k}": v for k, v in want.items()}
        assert _by_name(wrapped, zero_state.param_names(wrapped)) == prefixed
        assert _names_without_get_fqns(monkeypatch, wrapped) == prefixed

    one_rank(body, str(tmp_path))
    warnings = [r.message for r in caplog.records if "_get_fqns" in r.message]
    assert len(warnings) == 1 and "has no torch.distributed.checkpoint" in warnings[0]


@pytest.mark.parametrize("changed", [
    lambda module, name: name,                         # one name, but not in a set
    lambda module, name: {"a", "b"},                   # several names
    lambda module: {"x"},                              # another signature
], ids=["str", "two-names", "signature"])
def test_a_changed_get_fqns_falls_back_to_the_module_path(monkeypatch, changed):
    from torch.distributed.checkpoint import state_dict
    monkeypatch.setattr(log, "_SAID", set())
    plain = _mlp()
    with monkeypatch.context() as patch:
        patch.setattr(state_dict, "_get_fqns", changed)
        names = _by_name(plain, zero_state.param_names(plain))
    assert names == {n: n for n, _ in plain.named_parameters()}
    assert log._SAID == {(zero_state.__name__, "_get_fqns")}


def test_zero1_saves_and_resumes_without_get_fqns(tmp_path, monkeypatch):
    """A one-rank ZeRO-1 run: saved with torch's _get_fqns and without it (hidden from the
    zero_state module only: torch's own state dict functions still need it), the checkpoints
    hold the same entries, and a resume without it restores the optimizer state."""
    from torch.distributed.checkpoint import FileSystemReader

    def zero1():
        ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
        planned = PlannedModel(ddp, ddp.module, Strategy.ZERO1, KIND_DDP)
        return planned, wrap_optimizer(planned, torch.optim.AdamW(ddp.parameters(), lr=1e-2))

    def state(optimizer) -> list[list[float]]:
        local = optimizer.optim.state
        return [v.flatten().tolist() for s in local.values() for v in s.values()]

    def body():
        planned, optimizer = zero1()
        _step(planned, optimizer)
        save_sharded(tmp_path / "with", planned, optimizer, step=1, loader_state={},
                     guard_state=None)
        monkeypatch.setattr(zero_state, "_torch_get_fqns", lambda: None)
        save_sharded(tmp_path / "without", planned, optimizer, step=1, loader_state={},
                     guard_state=None)
        fresh, fresh_optimizer = zero1()
        load_sharded(tmp_path / "without", fresh, fresh_optimizer, world_rank=0)
        assert state(fresh_optimizer) == state(optimizer) != []
        _step(fresh, fresh_optimizer)                   # the run goes on

    one_rank(body, str(tmp_path))
    keys = [set(FileSystemReader(str(tmp_path / d)).read_metadata().state_dict_metadata)
            for d in ("with", "without")]
    assert keys[0] == keys[1]
    assert "optimizer.state.2.0.weight.exp_avg" in keys[0]
