"""Batch bytes of real batches and the list-backed dataset check (torch adapter)."""

import collections

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import PlanInputError
from raytrain_guard.planner.batch_inspect import (
    is_list_backed,
    list_backed_attributes,
    measure_batch,
    measure_dataset,
)
from raytrain_guard.planner.batches import batch_nbytes, batch_signature, leading_batch_size

Pair = collections.namedtuple("Pair", "x y")


@pytest.mark.parametrize("batch, nbytes, size", [
    # 8 x 16 float32 = 512 B
    (torch.zeros(8, 16), 512, 8),
    # dict: ids 8 x 128 int64 = 8192 B, mask 8 x 128 bool = 1024 B, a string counts 0
    ({"ids": torch.zeros(8, 128, dtype=torch.int64),
      "mask": torch.zeros(8, 128, dtype=torch.bool), "name": "batch-0"}, 9216, 8),
    # named tuple of bf16 4 x 3 x 32 x 32 (24576 B) and int64 labels 4 (32 B)
    (Pair(torch.zeros(4, 3, 32, 32, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long)),
     24608, 4),
    # numpy arrays count by nbytes: 6 x 10 float64 = 480 B
    ([np.zeros((6, 10)), 3], 480, 6),
    # a view counts at its own size: 2 rows of 100 float32 = 800 B
    (torch.zeros(50, 100)[:2], 800, 2),
])
def test_batch_bytes(batch, nbytes, size):
    assert batch_nbytes(batch) == nbytes
    assert leading_batch_size(batch) == size
    m = measure_batch(batch)
    assert (m.batch_bytes, m.batch_size) == (nbytes, size)
    assert m.bytes_per_sample == nbytes / size


def test_batch_without_tensors_is_bad_input():
    with pytest.raises(PlanInputError, match="--sample"):
        measure_batch({"text": ["a", "b"]})


class Lists(Dataset):
    def __init__(self, n=2000):
        self.rows = [[float(i)] * 4 for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return torch.tensor(self.rows[i])


class Tensors(Dataset):
    def __init__(self, n=2000):
        self.data = torch.zeros(n, 4)
        self.classes = ["cat", "dog"]           # a short list is fine

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def test_list_backed_detection():
    assert list_backed_attributes(Lists(), min_items=1024) == ["rows"]
    assert list_backed_attributes(Lists(100), min_items=1024) == []
    assert not is_list_backed(Tensors(), min_items=1024)
    # wrappers are followed; Subset's own index list is not the dataset's samples
    assert list_backed_attributes(Subset(Lists(), list(range(1500))), min_items=1024) == \
        ["dataset[0].rows"]
    assert not is_list_backed(Subset(Tensors(), list(range(1500))), min_items=1024)
    assert list_backed_attributes(ConcatDataset([Tensors(), Lists()]), min_items=1024) == \
        ["dataset[1].rows"]


def test_measure_dataset():
    # 8 samples of 4 float32 = 128 B collated
    m = measure_dataset(Tensors())
    assert (m.batch_bytes, m.batch_size, m.bytes_per_sample) == (128, 8, 16.0)
    # the sample count comes from the config (the guarded loader's probe reads as many):
    # 3 samples of 4 float32 = 48 B
    m = measure_dataset(Tensors(), config=GuardConfig(loader_probe_samples=3))
    assert (m.batch_bytes, m.batch_size) == (48, 3)


class NumpySamples(Dataset):
    """Sample i: {"x": float32 numpy vector of 6, "y": int}; default_collate makes tensors."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": np.full(6, i, dtype=np.float32), "y": i}


def test_numpy_batches_count_their_bytes_and_shapes():
    # a batch a custom collate leaves as numpy: 4 x 6 float32 = 96 B + 4 int64 = 32 B
    batch = {"x": np.zeros((4, 6), dtype=np.float32), "y": np.arange(4)}
    assert batch_nbytes(batch) == 128 and leading_batch_size(batch) == 4
    assert batch_signature(batch) == ("dict", (("x", ("array", "float32", (6,))),
                                               ("y", ("array", "int64", ()))))
    # numpy samples collated: 8 x (6 x 4 B + 8 B) = 256 B
    assert measure_dataset(NumpySamples()).batch_bytes == 256


def test_samples_that_differ_are_named():
    class Mixed(Tensors):
        def __getitem__(self, i):
            return torch.zeros(3 if i == 2 else 4)

    with pytest.raises(PlanInputError, match="sample 2 differs") as err:
        measure_dataset(Mixed())
    assert err.value.field == "--dataset"


def test_dataset_that_raises_is_bad_input():
    class Broken(Tensors):
        def __getitem__(self, i):
            raise KeyError(i)

    with pytest.raises(PlanInputError, match="reading samples failed"):
        measure_dataset(Broken())
