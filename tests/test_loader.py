"""The guarded DataLoader with real torch DataLoader worker processes (no Ray here).

Ranks are simulated by building one loader per rank in this process: the sharding is a pure
function of (seed, epoch, rank, world size), which is what the tests pin down.
"""

from __future__ import annotations

import collections
import itertools
import pickle

import pytest
import torch
from torch.utils.data import DistributedSampler

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, PlanInputError
from raytrain_guard.planner.batches import batch_nbytes
from raytrain_guard.runtime.data.loader import GuardedDataLoader
from raytrain_guard.runtime.data.sampler import ResumableDistributedSampler

MiB = 1024**2


class IndexDataset:
    """Sample i is the int64 scalar tensor i (8 bytes), stored in one tensor."""

    def __init__(self, n: int) -> None:
        self.values = torch.arange(n)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.values[i]


class CountingDataset(IndexDataset):
    """Counts __getitem__ calls (only meaningful with num_workers=0: same process)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.reads: list[int] = []

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads.append(int(i))
        return self.values[i]


class VectorDataset:
    """Sample i: float32 vector of ``dim`` elements (4 * dim bytes), all equal to i."""

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.dim,), float(i))


def make(dataset, batch_size, **kw) -> GuardedDataLoader:
    kw.setdefault("world_rank", 0)
    kw.setdefault("world_size", 1)
    kw.setdefault("num_workers", 2)
    kw.setdefault("watch_worker_memory", False)
    return GuardedDataLoader(dataset, batch_size, **kw)


def epoch_of(loader) -> list[int]:
    return [int(v) for batch in loader for v in batch.reshape(-1).tolist()]


@pytest.fixture
def loaders():
    made: list[GuardedDataLoader] = []

    def build(*args, **kw):
        loader = make(*args, **kw)
        made.append(loader)
        return loader

    yield build
    for loader in made:
        loader.close()


# -- the sampler (pure index arithmetic, no workers) ----------------------------------------------
@pytest.mark.parametrize("n,world,shuffle,drop_last", [
    (10, 1, True, False), (10, 3, True, False), (10, 3, True, True), (7, 2, False, False),
    (2, 3, True, False),      # fewer samples than ranks: padding repeats the permutation
    (12, 4, True, True),
])
def test_sampler_matches_distributed_sampler_from_the_start(n, world, shuffle, drop_last):
    for rank, epoch in itertools.product(range(world), range(2)):
        ours = ResumableDistributedSampler(range(n), num_replicas=world, rank=rank,
                                           shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                    seed=5, drop_last=drop_last)
        ours.set_epoch(epoch), theirs.set_epoch(epoch)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("n,world,batch,k", [(10, 3, 1, 2), (23, 2, 4, 2), (23, 4, 2, 1)])
def test_sampler_start_skips_exactly_the_consumed_batches(n, world, batch, k):
    # after every rank took k batches of `batch`, positions 0 .. k*batch*world-1 are consumed;
    # starting there each rank continues its own DistributedSampler shard after k*batch indices.
    for rank in range(world):
        full = list(DistributedSampler(range(n), num_replicas=world, rank=rank, seed=1))
        ours = ResumableDistributedSampler(range(n), num_replicas=world, rank=rank, seed=1)
        ours.set_start(k * batch * world)
        rest = list(ours)
        assert rest[:len(full) - k * batch] == full[k * batch:]


# -- exactly once, determinism -------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch_across_ranks(loaders, world, drop_last):
    n, batch = 23, 4
    ranks = [loaders(IndexDataset(n), batch, world_rank=r, world_size=world, seed=3,
                     drop_last=drop_last) for r in range(world)]
    for epoch in range(2):
        shards = [[b.tolist() for b in loader] for loader in ranks]
        assert len({len(s) for s in shards}) == 1          # equal step counts on every rank
        assert all(len(s) == len(loader) for s, loader in zip(shards, ranks))
        seen = collections.Counter(v for s in shards for b in s for v in b)
        perm = ResumableDistributedSampler(range(n), num_replicas=world, rank=0, seed=3)
        perm.set_epoch(epoch)
        order = perm.epoch_permutation()
        if drop_last:
            # n % world samples skipped (the tail of this epoch's permutation), no repeats, and
            # each rank's incomplete last batch dropped
            per_rank = (n // world) // batch * batch
            assert sum(seen.values()) == per_rank * world
            assert set(seen.values()) == {1}
        else:
            # padding: the first (-n) % world samples of the permutation come twice (documented)
            pad = (-n) % world
            assert set(seen) == set(range(n))
            assert sorted(v for v, c in seen.items() if c == 2) == sorted(order[:pad])
            assert sum(seen.values()) == n + pad
        assert all(loader.epoch == epoch + 1 for loader in ranks)  # set_epoch done by the loader


def test_same_seed_same_order_other_seed_or_epoch_differs(loaders):
    a = loaders(IndexDataset(40), 5, seed=7)
    b = loaders(IndexDataset(40), 5, seed=7, num_workers=0)
    c = loaders(IndexDataset(40), 5, seed=8)
    first_a, first_b, first_c = epoch_of(a), epoch_of(b), epoch_of(c)
    assert first_a == first_b                    # worker count does not change the order
    assert first_a != first_c
    assert epoch_of(a) != first_a                # next epoch: a new permutation
    assert sorted(first_a) == list(range(40))


# -- resume -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 3])
def test_resume_mid_epoch_loses_and_repeats_nothing(loaders, world):
    n, batch, k = 50, 4, 2
    reference = [loaders(IndexDataset(n), batch, world_rank=r, world_size=world, seed=11)
                 for r in range(world)]
    uninterrupted = [[b.tolist() for b in loader] for loader in reference]
    first = [loaders(IndexDataset(n), batch, world_rank=r, world_size=world, seed=11)
             for r in range(world)]
    before, states = [], []
    for loader in first:
        it = iter(loader)
        before.append([next(it).tolist() for _ in range(k)])
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
    assert states[0]["batches_consumed"] == k and states[0]["epoch"] == 0
    assert states[0]["samples_consumed"] == k * batch * world
    resumed = []
    for r, state in enumerate(states):
        loader = loaders(IndexDataset(n), batch, world_rank=r, world_size=world, seed=0)
        loader.load_state_dict(state)               # the saved seed wins
        resumed.append([b.tolist() for b in loader])
        assert loader.epoch == 1
    for r in range(world):
        assert before[r] + resumed[r] == uninterrupted[r]


def test_the_saved_drop_last_and_seed_reach_the_torch_loader(loaders):
    # 10 samples in batches of 4: drop_last=True gives 2 batches, False 3. A state saved with
    # drop_last=True and seed 5 is an epoch of the saved loader, whatever this one was built with
    saved = loaders(IndexDataset(10), 4, num_workers=0, seed=5, drop_last=True)
    want = [b.tolist() for b in saved]
    loader = loaders(IndexDataset(10), 4, num_workers=0, seed=0, drop_last=False)
    loader.load_state_dict({"epoch": 0, "batches_consumed": 0, "seed": 5, "drop_last": True})
    assert [b.tolist() for b in loader] == want and len(want) == 2


def test_resume_skips_in_the_sampler_without_reading_samples(loaders):
    ds = CountingDataset(40)
    loader = loaders(ds, 4, num_workers=0, seed=2)
    probe_reads = len(ds.reads)                      # dataset[0..k-1] measured at construction
    loader.load_state_dict({"epoch": 0, "batches_consumed": 6, "seed": 2})
    rest = epoch_of(loader)
    assert len(rest) == 40 - 24
    assert len(ds.reads) - probe_reads == 16         # only the 16 remaining samples were read


def test_resume_with_another_world_size_covers_the_rest_once(loaders):
    n, batch = 60, 5
    old = [loaders(IndexDataset(n), batch, world_rank=r, world_size=2, seed=4) for r in range(2)]
    consumed = []
    for loader in old:
        it = iter(loader)
        consumed += [v for _ in range(3) for v in next(it).tolist()]
    state = old[0].state_dict()                      # 3 batches x 5 x 2 ranks = position 30
    new = [loaders(IndexDataset(n), batch, world_rank=r, world_size=3, seed=4) for r in range(3)]
    rest = []
    for loader in new:
        loader.load_state_dict(state)
        rest += epoch_of(loader)
    assert sorted(consumed + rest) == list(range(n))  # 30 left, 30 % 3 == 0: no padding


def test_state_saved_after_the_last_batch_resumes_at_the_next_epoch(loaders):
    loader = loaders(IndexDataset(12), 4, seed=6)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)                                    # the last batch taken, no StopIteration yet
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (0, 3)
    resumed = loaders(IndexDataset(12), 4, seed=6)
    resumed.load_state_dict(state)
    reference = loaders(IndexDataset(12), 4, seed=6)
    epoch_of(reference)
    assert epoch_of(resumed) == epoch_of(reference)   # both deliver epoch 1 in full
    assert resumed.epoch == reference.epoch == 2


@pytest.mark.parametrize("total,available,limit,usage,expected", [
    (64, 40, None, None, (64, 40)),      # no cgroup limit
    (64, 40, 128, 10, (64, 40)),         # limit above the machine: the machine counts
    (64, 40, 16, 10, (16, 6)),           # 16 GiB container with 10 used: 6 available
    (64, 4, 16, 2, (16, 4)),             # the machine is the tighter one
])
def test_host_memory_is_narrowed_to_the_cgroup(total, available, limit, usage, expected):
    from raytrain_guard.runtime.host_memory import within_cgroup

    assert within_cgroup(total, available, limit, usage) == expected


def test_breaking_out_and_iterating_again_continues_the_epoch(loaders):
    loader = loaders(IndexDataset(30), 3, seed=9)
    full = epoch_of(loaders(IndexDataset(30), 3, seed=9))
    head = []
    for i, b in enumerate(loader):
        head += b.tolist()
        if i == 3:
            break
    assert head + epoch_of(loader) == full
    assert loader.epoch == 1


def test_set_epoch_on_the_current_epoch_keeps_a_resume(loaders):
    loader = loaders(IndexDataset(20), 2, seed=1)
    loader.load_state_dict({"epoch": 3, "batches_consumed": 4, "seed": 1})
    loader.set_epoch(3)                              # the usual loop calls this every epoch
    assert len(epoch_of(loader)) == 20 - 8
    loader.set_epoch(7)
    assert loader.epoch == 7 and len(epoch_of(loader)) == 20


# -- the torch DataLoader really gets the planned knobs ----------------------------------------
def test_prefetch_factor_and_persistent_workers_reach_torch(loaders):
    loader = loaders(VectorDataset(64, 256), 8, num_workers=None, cpus_per_node=4,
                     gpus_per_node=1, host_memory_bytes=1024 * MiB)
    # rule: 4 cores - 1 = 3 workers; budget 5 % x 1 GiB = 53687091 B; batch 8 x 1 KiB = 8 KiB;
    # prefetch = min(8, 53687091 // (3 x 8192)) = 8
    assert (loader.plan.num_workers, loader.plan.prefetch_factor) == (3, 8)
    assert loader.plan.host_bytes == 3 * 8 * 8192
    assert loader.probe_batch_bytes == 8192
    epoch_of(loader)
    torch_loader = loader.torch_loader
    assert torch_loader.num_workers == 3 and torch_loader.prefetch_factor == 8
    assert torch_loader.persistent_workers
    assert loader._pipeline.torch_iter._prefetch_factor == 8
    pids = loader.worker_pids()
    assert len(pids) == 3
    epoch_of(loader)
    assert loader.worker_pids() == pids              # persistent: the same processes


def test_given_num_workers_gets_the_prefetch_that_fits(loaders):
    loader = loaders(VectorDataset(64, 1024), 16, num_workers=5, host_memory_bytes=16 * MiB)
    # batch 16 x 4 KiB = 65536 B; budget 5 % x 16 MiB = 838860 B; 838860 // (5 x 65536) = 2
    assert (loader.plan.num_workers, loader.plan.prefetch_factor) == (5, 2)
    assert loader.plan.host_bytes == 5 * 2 * 65536 <= loader.plan.budget_bytes


def test_given_prefetch_factor_is_kept(loaders):
    loader = loaders(IndexDataset(32), 4, num_workers=2, prefetch_factor=3,
                     persistent_workers=False)
    epoch_of(loader)
    assert loader.torch_loader.prefetch_factor == 3
    assert not loader.torch_loader.persistent_workers


@pytest.mark.parametrize("device", [None, "cpu"])
def test_request_prefetch_factor_applies_at_the_next_batch_without_loss_or_repeat(loaders,
                                                                                  device):
    # 40 samples, batch 4, one rank: 10 batches. The cap lands after batch 3 of epoch 0; the
    # torch iterator is rebuilt at sample 12 (what the training loop took, not what the workers
    # and the background stage had fetched ahead), so epoch 0 is still 0..39 once each.
    loader = loaders(IndexDataset(40), 4, num_workers=2, host_memory_bytes=1024 * MiB, seed=7,
                     device=device, device_prefetch_depth=2)
    assert loader.plan.prefetch_factor == 8 and loader.prefetch_factor == 8
    it = iter(loader)
    got = [int(v) for _ in range(3) for v in next(it).tolist()]
    pids = loader.worker_pids()
    loader.request_prefetch_factor(2)
    # reported at once (what the train loop's setup() reads), applied from the next batch
    assert loader.plan.prefetch_factor == 2 and loader.prefetch_factor == 2
    assert "capped at 2 by request" in loader.plan.reason
    got += [int(v) for v in next(it).tolist()]
    assert loader.torch_loader.prefetch_factor == 2 and loader._pipeline.torch_iter._prefetch_factor == 2
    assert loader.worker_pids() != pids and len(loader.worker_pids()) == 2
    got += [int(v) for batch in it for v in batch.tolist()]
    assert sorted(got) == list(range(40))                  # nothing lost, nothing repeated
    plain = loaders(IndexDataset(40), 4, num_workers=0, seed=7)
    assert got == epoch_of(plain)                          # and in the epoch's order
    assert loader.stats()["replans"] == 1 and loader.epoch == 1
    state = loader.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)
    loader.request_prefetch_factor(None)                   # lifted between epochs
    assert loader.prefetch_factor == 8
    assert sorted(epoch_of(loader)) == list(range(40))
    assert loader.torch_loader.prefetch_factor == 8 and loader.stats()["replans"] == 2


def test_request_at_the_same_factor_keeps_the_workers(loaders):
    loader = loaders(IndexDataset(40), 4, num_workers=2, host_memory_bytes=1024 * MiB)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    loader.request_prefetch_factor(8)                      # the plan's own value: no change
    assert len(list(it)) == 9 and loader.worker_pids() == pids
    assert loader.stats()["replans"] == 0


class GrowingSamples:
    """Samples 0..7 hold 16 floats, the others 4096 (variable length, padded by the collate)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(16 if i < 8 else 4096)


def pad_collate(samples):
    longest = max(len(s) for s in samples)
    return torch.stack([torch.nn.functional.pad(s, (0, longest - len(s))) for s in samples])


def test_replan_uses_the_measured_batches_not_the_probe(loaders):
    loader = loaders(GrowingSamples(), 8, shuffle=False, collate_fn=pad_collate,
                     host_memory_bytes=16 * MiB, cpus_per_node=2, gpus_per_node=1)
    # probe: samples 0..7 -> 8 x 16 x 4 = 512 B; budget 5 % x 16 MiB = 838860 B;
    # 838860 // (2 x 512) = 819 -> prefetch 8
    assert loader.probe_batch_bytes == 512 and loader.plan.prefetch_factor == 8
    epoch_of(loader)
    assert loader.stats()["max_batch_bytes"] == 8 * 4096 * 4          # 131072 B measured
    epoch_of(loader)
    # measured: 838860 // (2 x 131072) = 3
    assert loader.plan.prefetch_factor == 3 and loader.torch_loader.prefetch_factor == 3
    assert loader.stats()["replans"] == 1


def test_host_pressure_lowers_prefetch_at_the_epoch_boundary(loaders):
    host = {"total": 64 * MiB, "available": 60 * MiB}
    loader = loaders(VectorDataset(64, 1024), 16, gpus_per_node=1, cpus_per_node=2,
                     host_memory_probe=lambda: (host["total"], host["available"]))
    # batch 16 x 4 KiB = 64 KiB; budget 5 % x 64 MiB = 3355443 B; 3355443 // (2 x 65536) = 25 -> 8
    assert loader.plan.prefetch_factor == 8
    epoch_of(loader)
    host["available"] = 6 * MiB                       # 90.6 % used >= 0.90 watermark
    epoch_of(loader)
    # budget from available: 5 % x 6 MiB = 314572 B; 314572 // (2 x 65536) = 2
    assert loader.plan.prefetch_factor == 2 and loader.plan.budget_bytes == 314572
    assert loader.plan.reason.startswith("host under pressure")
    assert loader.torch_loader.prefetch_factor == 2


# -- data wait and bytes --------------------------------------------------------------------------
def test_data_wait_and_batch_bytes_are_counted_per_step(loaders):
    ticks = itertools.count()
    loader = loaders(VectorDataset(20, 16), 4, clock=lambda: float(next(ticks)))
    batches = list(loader)
    # fake clock, +1 per read: start 0; each step reads t0, then now = t0 + 1 -> wait 1 s;
    # wall between yields: 2 s (first: 2 - 0); 5 batches -> wait 5, wall 10
    stats = loader.stats()
    assert stats["batches"] == 5 and stats["data_wait_total_s"] == 5.0
    assert stats["wall_total_s"] == 10.0 and stats["data_wait_frac"] == 0.5
    assert loader.last_data_wait_s == 1.0
    assert loader.last_batch_bytes == batch_nbytes(batches[-1]) == 4 * 16 * 4
    # in flight: 2 workers x prefetch 8 x 256 B = 4096 B, plus depth 1 x 256 B held by the
    # background stage that takes batches from the workers (host memory): 4352 B
    assert loader.plan.prefetch_factor == 8
    assert stats["bytes_in_flight_estimate"] == stats["host_bytes_in_flight_estimate"] == 4352


def test_data_wait_includes_a_slow_dataset(loaders):
    import time

    class Slow(VectorDataset):
        def __getitem__(self, i):
            time.sleep(0.005)
            return super().__getitem__(i)

    loader = loaders(Slow(8, 4), 4, num_workers=0)
    epoch_of(loader)
    assert loader.stats()["data_wait_total_s"] >= 8 * 0.005   # sleep is a lower bound


# -- device prefetch stage (CPU here; CUDA in test_loader_cuda) -----------------------------------
def test_device_prefetch_keeps_order_and_depth_changes_at_run_time(loaders):
    plain = epoch_of(loaders(IndexDataset(30), 3, seed=5))
    loader = loaders(IndexDataset(30), 3, seed=5, device="cpu", device_prefetch_depth=1)
    got = []
    for i, b in enumerate(loader):
        got += b.tolist()
        if i == 2:
            assert loader.set_device_prefetch_depth(3) == 3
            assert loader._pipeline.stage._depth == 3      # the live stage keeps 3 ready
    assert got == plain
    assert loader.device_prefetch_depth == 3


def test_device_prefetch_depth_is_held_within_the_host_budget(loaders):
    # host 1 MiB: budget 5 % = 52428 B; batch 16 x 1 KiB = 16 KiB: 2 workers x prefetch 1 =
    # 32 KiB; room 52428 - 32768 = 19660 B -> one more batch on the (host) device stage
    loader = loaders(VectorDataset(64, 256), 16, host_memory_bytes=1 * MiB, device="cpu",
                     device_prefetch_depth=0)
    assert loader.plan.prefetch_factor == 1
    assert loader.set_device_prefetch_depth(4) == 1


# -- bad input ----------------------------------------------------------------------------------
class Mixed(VectorDataset):
    def __getitem__(self, i):
        return torch.zeros(3) if i == self.dim else torch.zeros(4)


@pytest.mark.parametrize("make_loader,field,words", [
    (lambda: make(IndexDataset(0), 4), "dataset", "empty"),
    (lambda: make([], 4), "dataset", "empty"),
    (lambda: make(Mixed(16, 2), 4), "dataset", "sample 2 differs"),       # within the probe
    (lambda: make(VectorDataset(8, 4), 0), "batch_size", ">= 1"),
    (lambda: make(VectorDataset(8, 4), 2, world_rank=3, world_size=3), "world_rank", "[0, 2]"),
    (lambda: make(VectorDataset(5, 4), 2, world_size=3, drop_last=True), "batch_size",
     "no batch"),
    (lambda: make(VectorDataset(8, 256), 4, host_memory_bytes=64 * 1024), "batch_bytes",
     "exceeds the host prefetch budget"),   # 4 KiB batch > 5 % x 64 KiB = 3276 B
    (lambda: make(VectorDataset(8, 4), 2, device_prefetch_depth=-1), "device_prefetch_depth",
     ">= 0"),
])
def test_bad_input_is_an_input_error_at_construction(make_loader, field, words):
    with pytest.raises(InputError) as err:
        make_loader()
    assert err.value.field == field and words in str(err.value)
    assert err.value.fix
    assert pickle.loads(pickle.dumps(err.value)).field == field


def test_batch_over_budget_is_a_plan_input_error_naming_the_fix():
    with pytest.raises(PlanInputError, match="smaller micro-batch"):
        make(VectorDataset(8, 256), 4, host_memory_bytes=64 * 1024)


@pytest.mark.parametrize("workers", [0, 2])
def test_inconsistent_sample_after_the_probe_fails_promptly(loaders, workers):
    loader = loaders(Mixed(40, 13), 4, num_workers=workers, shuffle=False)
    with pytest.raises(InputError, match="different shapes") as err:
        epoch_of(loader)
    assert err.value.field == "dataset"


def test_inconsistent_batch_type_is_caught_from_the_first_batches(loaders):
    def collate(samples):   # the user's collate returns a dict once, a tensor otherwise
        out = torch.stack(samples)
        return {"x": out} if int(out[0, 0]) == 4 else out
    loader = loaders(VectorDataset(16, 2), 4, num_workers=0, shuffle=False, collate_fn=collate)
    with pytest.raises(InputError, match="batch 1 differs in type"):
        epoch_of(loader)


class Labelled:
    """Sample i: {"x": 4 floats, "name": a string}; strings collate to a list per batch."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((4,), float(i)), "name": f"item{i}"}


def test_string_fields_and_a_short_last_batch_are_consistent(loaders):
    loader = loaders(Labelled(), 4, num_workers=0)        # batches of 4, 4 and 2
    names = [n for batch in loader for n in batch["name"]]
    assert sorted(names) == sorted(f"item{i}" for i in range(10))


def test_state_dict_from_another_dataset_is_refused(loaders):
    loader = loaders(IndexDataset(10), 2)
    with pytest.raises(InputError, match="num_samples"):
        loader.load_state_dict({"epoch": 0, "batches_consumed": 1, "num_samples": 11})


def test_default_config_is_the_seed_rule():
    assert GuardConfig().host_prefetch_frac == 0.05


# -- background stage (CPU, workers): the training thread does not take batches from the workers
def test_background_stage_counts_delivered_batches_not_fetched_ones(loaders):
    import threading
    import time

    loader = loaders(IndexDataset(40), 4, num_workers=2, seed=1, device_prefetch_depth=3)
    it = iter(loader)
    first = next(it).tolist()
    stage = loader._pipeline.stage
    deadline = time.monotonic() + 10
    while len(stage._ready) < 3 and time.monotonic() < deadline:  # the thread fills its depth
        time.sleep(0.01)
    assert len(stage._ready) == 3                    # 3 batches fetched ahead, not delivered
    state = loader.state_dict()
    assert state["samples_consumed"] == 4 and state["batches_consumed"] == 1
    resumed = loaders(IndexDataset(40), 4, num_workers=0, seed=1)
    resumed.load_state_dict(state)
    assert sorted(first + epoch_of(resumed)) == list(range(40))
    loader.close()
    assert not any(t.name == "raytrain_guard-batches" and t.is_alive()
                   for t in threading.enumerate())


def test_threaded_prefetcher_keeps_order_ends_and_forwards_errors():
    from raytrain_guard.runtime.data.device_prefetch import ThreadedPrefetcher

    stage = ThreadedPrefetcher(iter(range(5)), depth=2)
    assert list(stage) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):               # stays ended
        next(stage)
    stage.close()

    def broken():
        yield 1
        raise KeyError("sample 7")
    stage = ThreadedPrefetcher(broken(), depth=1)
    assert next(stage) == 1
    with pytest.raises(KeyError, match="sample 7"):
        next(stage)
    stage.close()


# -- the probe and the list-backed check are batch_inspect's ---------------------------------------
class NumpyRows:
    """Sample i: a float32 numpy row of 32 (128 B); the collate below keeps numpy batches."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        import numpy as np

        return np.full(32, i, dtype=np.float32)


def test_numpy_batches_are_measured_and_wrapped_lists_detected(loaders):
    import numpy as np
    from torch.utils.data import Subset

    loader = loaders(NumpyRows(), 8, num_workers=0, collate_fn=np.stack)
    # probe: 8 x 32 float32 = 1024 B (batch_nbytes once returned 0 for numpy: the plan then
    # sized from a 1-byte batch)
    assert loader.probe_batch_bytes == 1024
    assert sum(b.nbytes for b in loader) == 64 * 128 and loader.stats()["max_batch_bytes"] == 1024

    class Lists:
        def __init__(self) -> None:
            self.rows = [float(i) for i in range(2048)]      # >= list_dataset_min_items

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor(self.rows[i])

    wrapped = loaders(Subset(Lists(), list(range(100))), 4, num_workers=0)
    assert any("Python lists" in w for w in wrapped.plan.warnings)   # Subset followed
