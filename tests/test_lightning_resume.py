"""``position_resumed_loader`` on a single-process Lightning ``Trainer`` (no Ray): a fit
restored from a checkpoint saved inside an epoch (``ModelCheckpoint(every_n_train_steps)``,
as the guard's stop saves one) trains the rest of that epoch, not its first batches again."""

from __future__ import annotations

import glob
import os

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch
from torch.utils.data import DataLoader

from raytrain_guard.integrations.lightning import position_resumed_loader

SAMPLES, BATCH, EPOCHS = 64, 8, 2
PER_EPOCH = SAMPLES // BATCH                        # 8 batches


class Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": torch.full((4,), float(i))}


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch["x"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Record(pl.Callback):
    """The ids trained per epoch; stops after step ``stop_at``; positions a resumed loader."""

    def __init__(self, stop_at: int | None, position: bool) -> None:
        self.stop_at, self.position = stop_at, position
        self.ids: dict[int, list[int]] = {}
        self.left_out: int | None = None

    def on_train_start(self, trainer, module):
        if self.position:
            self.left_out = position_resumed_loader(trainer)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.ids.setdefault(trainer.current_epoch, []).extend(batch["id"].tolist())
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def _fit(tmp_path, record: Record, *, every: int, ckpt_path: str | None = None) -> pl.Trainer:
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path),
                         callbacks=[record, pl.callbacks.ModelCheckpoint(
                             dirpath=str(tmp_path / "ckpt"), every_n_train_steps=every,
                             save_top_k=-1, save_on_train_epoch_end=False)])
    loader = DataLoader(Ids(), batch_size=BATCH, shuffle=False)
    trainer.fit(Model(), train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer


def _stop_and_resume(tmp_path, stop: int, position: bool) -> tuple[Record, Record, pl.Trainer]:
    first = Record(stop_at=stop, position=position)
    _fit(tmp_path, first, every=stop)
    (path,) = glob.glob(os.path.join(tmp_path, "ckpt", f"*step={stop}.ckpt"))
    second = Record(stop_at=None, position=position)
    return first, second, _fit(tmp_path, second, every=stop, ckpt_path=path)


@pytest.mark.parametrize("stop", [11, 8], ids=["inside an epoch", "at an epoch's last batch"])
def test_a_fit_resumed_inside_an_epoch_trains_the_rest_of_it(tmp_path, stop):
    first, second, trainer = _stop_and_resume(tmp_path, stop, position=True)
    assert trainer.global_step == EPOCHS * PER_EPOCH
    trained = {e: first.ids.get(e, []) + second.ids.get(e, []) for e in range(EPOCHS)}
    assert trained == {e: list(range(SAMPLES)) for e in range(EPOCHS)}
    assert second.left_out == stop % PER_EPOCH


def test_lightning_alone_trains_the_epochs_start_again(tmp_path):
    """What the positioning is for; should Lightning ever position a plain DataLoader itself,
    this fails, and the guard's positioning would leave out batches twice."""
    first, second, trainer = _stop_and_resume(tmp_path, 11, position=False)
    assert trainer.global_step == EPOCHS * PER_EPOCH
    assert first.ids[1] == list(range(3 * BATCH))
    assert second.ids == {1: list(range(SAMPLES - 3 * BATCH))}


def test_a_fresh_fit_is_left_as_it_is(tmp_path):
    record = Record(stop_at=None, position=True)
    _fit(tmp_path, record, every=1000)
    assert record.left_out == 0
    assert record.ids == {e: list(range(SAMPLES)) for e in range(EPOCHS)}
