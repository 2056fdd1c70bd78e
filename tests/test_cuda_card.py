"""The CUDA card's figures from the caching allocator's counters (a fake torch.cuda: this
machine has no GPU; benchmarks/gpu_checks.sh runs the real one)."""

from __future__ import annotations

import pytest

from raytrain_guard.runtime.guard.cuda_card import CudaCard


class _FakeCuda:
    """Allocated bytes and a peak counter, as the caching allocator keeps them."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.allocated = 0
        self.peak = 0
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def get_device_properties(self, device):
        return type("Props", (), {"total_memory": self.total})()

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.resets += 1
        self.peak = self.allocated


def test_a_micro_batch_measures_what_it_allocates_beyond_what_was_held():
    cuda = _FakeCuda(total=1000)
    cuda.alloc(300)                                  # parameters and optimizer state
    card = CudaCard("cuda:0", cuda=cuda)
    assert card.capacity_bytes == 1000 and card.base_bytes == 300
    with card.tracking():
        cuda.alloc(250)                              # activations
        cuda.alloc(-250)                             # freed by backward
        cuda.alloc(100)                              # gradients
    assert card.last_activation_bytes == 250
    assert card.base_bytes == 400
    with card.tracking():                            # the next micro-batch: smaller
        cuda.alloc(120)
        cuda.alloc(-120)
    assert card.last_activation_bytes == 120
    assert card.step_peak_bytes == 550               # the step's highest, across micro-batches
    card.new_step()
    with card.tracking():
        cuda.alloc(50)
        cuda.alloc(-50)
    assert card.step_peak_bytes == 450               # a new step starts over
    assert cuda.resets == 3                          # one reset per micro-batch, nothing else


def test_without_a_cap_the_card_is_torch_cudas_device(monkeypatch):
    # the train loop builds CudaCard(device) on a GPU: the card's size comes from torch.cuda
    monkeypatch.setattr("raytrain_guard.runtime.guard.cuda_card.torch.cuda", _FakeCuda(total=800))
    assert CudaCard("cuda:0").capacity_bytes == 800


def test_a_capped_run_prices_against_its_cap():
    card = CudaCard("cuda:0", 600, cuda=_FakeCuda(total=1000))
    assert card.capacity_bytes == 600


def test_the_measure_survives_a_failing_micro_batch():
    cuda = _FakeCuda(total=1000)
    card = CudaCard("cuda:0", cuda=cuda)
    with pytest.raises(RuntimeError), card.tracking():
        cuda.alloc(700)
        raise RuntimeError("out of memory")
    assert card.last_activation_bytes == 700


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_a_real_card_the_measure_is_the_allocators_peak_over_the_base():
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    card = CudaCard(torch.device("cuda"))
    x = torch.randn(64, 1024, device="cuda")
    base = torch.cuda.memory_allocated()
    with card.tracking():
        model(x).square().mean().backward()
    # saved: x, the first output and the GELU output (64 x 4096 fp32, twice), at least
    assert card.last_activation_bytes >= 2 * 64 * 4096 * 4
    assert card.step_peak_bytes == torch.cuda.max_memory_allocated()
    assert card.last_activation_bytes == card.step_peak_bytes - base
