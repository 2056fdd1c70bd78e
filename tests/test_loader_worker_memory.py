"""Copy-on-read detection in the DataLoader workers: the pure rule, then real worker processes."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from raytrain_guard.config import GuardConfig
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.data.worker_memory import GrowthDetector, WorkerMemoryWatcher

MiB = 1024**2


@pytest.mark.parametrize("samples,fires", [
    ([10, 20, 30, 40], True),          # +30 over 4 non-decreasing samples >= 25
    ([10, 20, 20, 40], True),          # a flat step is still steady
    ([10, 20, 15, 40], False),         # one dip breaks the run
    ([10, 11, 12, 13], False),         # rising but only +3 < 25
    ([10, 20, 30], False),             # window not full yet
    ([50, 10, 20, 30, 40], True),      # start-up drop, then 4 rising samples: 10 -> 40
    ([40, 40, 40, 40, 40, 40], False), # flat
])
def test_growth_rule(samples, fires):
    detector = GrowthDetector(num_samples=4, min_growth_bytes=25)
    verdicts = [detector.add(float(t), b) for t, b in enumerate(samples)]
    assert (verdicts[-1] is not None) == fires


def test_a_window_under_two_samples_is_an_input_error():
    from raytrain_guard.errors import InputError

    with pytest.raises(InputError, match="worker_memory_growth_samples") as err:
        GrowthDetector(num_samples=1, min_growth_bytes=25)
    assert err.value.field == "num_samples"


def test_watcher_warns_once_and_survives_a_failing_probe(caplog):
    readings = iter([100, 200, 300, 400, 500, 600])
    watcher = WorkerMemoryWatcher(lambda: (1, 2), interval_s=1.0, num_samples=3,
                                  min_growth_bytes=100, read=lambda pids: next(readings),
                                  clock=iter(range(100)).__next__)
    with caplog.at_level(logging.WARNING):
        fired = [watcher.sample() for _ in range(6)]
        assert watcher.sample() is None                  # readings exhausted: logged, not raised
    assert [f is not None for f in fired] == [False, False, True, False, False, False]
    assert watcher.verdict.from_bytes == 100 and watcher.verdict.to_bytes == 300
    assert sum("copy-on-read" in r.message for r in caplog.records) == 1
    assert sum("sampling failed" in r.message for r in caplog.records) == 1


class ListBacked:
    """200 samples, each a Python list of 10 000 floats (~64 MiB of objects in all)."""

    def __init__(self) -> None:
        self.items = [[float(i * 10_000 + j) for j in range(10_000)] for i in range(200)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.006)                     # a little per-sample cost: several samples/epoch
        return torch.tensor(sum(self.items[i]))   # reads every object: refcounts written


class TensorBacked:
    """The same numbers in one float64 tensor (16 MiB): read without writing."""

    def __init__(self) -> None:
        self.items = torch.arange(200 * 10_000, dtype=torch.float64).reshape(200, 10_000)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.006)
        return self.items[i].sum()


# sample every 100 ms; 4 rising samples gaining >= 16 MiB warn. Measured here: the list-backed
# workers climb from ~20 to ~110 MiB in one epoch (~0.6 s), the tensor-backed ones stay at
# ~22 MiB. A 300 ms window holds ~40 MiB of the climb: room for workers a loaded box slows.
FAST = GuardConfig(worker_memory_interval_s=0.1, worker_memory_growth_samples=4,
                   worker_memory_growth_bytes=16 * MiB)


@pytest.mark.parametrize("dataset_cls,warns", [(ListBacked, True), (TensorBacked, False)])
def test_copy_on_read_warning_fires_only_for_python_object_storage(dataset_cls, warns, caplog):
    loader = GuardedDataLoader(dataset_cls(), 4, world_rank=0, world_size=1, num_workers=2,
                               config=FAST, seed=0)
    try:
        with caplog.at_level(logging.WARNING, logger="raytrain_guard.runtime.data.worker_memory"):
            for _ in range(2):
                for _batch in loader:
                    pass
        assert loader._watcher.num_samples_taken >= FAST.worker_memory_growth_samples
        assert loader.stats()["copy_on_read_warned"] is warns
        messages = [r.message for r in caplog.records if "copy-on-read" in r.message]
        assert len(messages) == (1 if warns else 0)          # once, not every sample
        if warns:
            assert "numpy arrays or torch tensors" in messages[0]
    finally:
        loader.close()
