"""``raytrain-guard demo``: a guarded training on an embedded local Ray cluster, in a minute or two.

Two gloo workers train the toy MLP of ``examples/toy.py`` through :func:`launch`: plan, node
monitor and coordinator, the shared train loop with lockstep decisions, a live progress line,
then the summary. Two failures are rehearsed on purpose (``--no-rehearsal`` turns them off) so
the summary has something to show on a CPU-only machine:

* the node monitor's GPU probe is scripted (``ScriptedGpuProbe``) to read 89 % GPU memory,
  above the 0.88 watermark: the coordinator decides a cache release, and every rank applies
  it at the same step;
* rank 1 sleeps ``straggler_delay_s`` in every forward pass (``FaultInjector``): the run names
  it the compute straggler.

A demo that cannot run is refused before Ray starts (:func:`plan_demo`): more workers than the
256 samples give a micro-batch each is bad input; more than this machine's memory plans for is a
plan that does not fit, with the largest ``--workers`` that does. Ray Train's storage is a
temporary directory, removed at the end (the summary holds what the run found).
"""

from __future__ import annotations

import importlib
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from raytrain_guard.cluster.launcher import (
    DEFAULT_NAMESPACE,
    ProgressPrinter,
    RunSummary,
    check_plan,
    launch,
    plan_run,
)
from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError
from raytrain_guard.units import GiB

REHEARSED_GPU_FRAC = 0.89
NUM_SAMPLES = 256            # the toy dataset of the demo
MICRO_BATCH = 8
MAX_WORKERS = NUM_SAMPLES // MICRO_BATCH    # 32: each rank one full micro-batch per epoch


def load_toy() -> Any:
    """``examples.toy`` from this checkout, pickled by value so workers need not import it."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "examples" / "toy.py").is_file():
        raise InputError("examples/toy.py", "not found next to the package", value=str(root),
                         fix="run the demo from a source checkout (pip install -e .)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    toy = importlib.import_module("examples.toy")
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(toy)
    return toy


def demo_config(toy: Any, *, epochs: int, rehearse: bool, straggler_delay_s: float
                ) -> dict[str, Any]:
    """The demo's ``train_loop_config``: 256 samples, micro-batch 8, ``epochs`` epochs."""
    import functools
    config: dict[str, Any] = {
        "model_factory": toy.make_model,
        "dataset_factory": functools.partial(toy.make_dataset, NUM_SAMPLES),
        "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
        "micro_batch": MICRO_BATCH, "grad_accum": 1, "epochs": epochs, "num_workers": 0,
        "checkpoint_every_steps": 10_000, "measure_bandwidth": True}
    if rehearse:
        config["faults"] = {"delay": [{"seconds": straggler_delay_s, "phase": "forward",
                                       "ranks": [1]}]}
    return config


def rehearsal_probes() -> Any:
    """Every node's GPU probe reads one 80 GiB GPU at ``REHEARSED_GPU_FRAC`` of its memory,
    holding the node's registered train workers (so it counts as the run's pressure)."""
    from raytrain_guard.cluster.node_probes import ScriptedProbeFactory
    from raytrain_guard.core.node_samples import GpuSample
    total = 80 * GiB
    return ScriptedProbeFactory([[GpuSample(0, int(REHEARSED_GPU_FRAC * total), total)]],
                                worker_gpus=(0,))


def demo_steps(num_workers: Any, epochs: Any) -> int:
    """Steps of the demo, counted as the train loop counts them (pure): each rank gets
    ceil(256 / workers) samples in ceil(that / 8) micro-batches per epoch. Raises InputError for
    a count below 1 (too many workers: :func:`plan_demo`)."""
    for flag, value in (("--workers", num_workers), ("--epochs", epochs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(flag, "must be a whole number of at least 1", value=value,
                             fix=f"pass e.g. {flag} 2")
    per_rank = -(-NUM_SAMPLES // num_workers)
    return -(-per_rank // MICRO_BATCH) * epochs


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in 1..``upper`` with ``fits(n)``, 0 if none (pure). ``fits`` must hold for
    a prefix of the range (fewer ranks: more memory each); a binary search, log2(upper) calls."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_demo(config: Mapping[str, Any], num_workers: int,
              plan_for: Callable[[int], Any] | None = None) -> Any:
    """The demo's capacity plan, made before Ray starts; refuses a demo that cannot run here.

    More workers than :data:`MAX_WORKERS` (256 samples at micro-batch 8) is bad input
    (InputError, exit 2); a plan that does not fit (each rank plans against this machine's RAM
    divided by the workers) raises :class:`PlanDoesNotFit` (exit 1). Both name the largest
    ``--workers`` that runs here, the only fix the demo offers. ``plan_for(workers) -> Plan``
    (default: :func:`plan_run` on ``config``) is the seam for tests.
    """
    plans: dict[int, Any] = {}

    def fits(workers: int) -> bool:
        if workers not in plans:
            plans[workers] = (plan_for or (lambda w: plan_run(config, num_workers=w,
                                                              config=GuardConfig())))(workers)
        return bool(plans[workers].fits)

    if num_workers > MAX_WORKERS:
        largest = largest_fitting(fits, MAX_WORKERS)
        raise InputError("--workers", f"the demo's {NUM_SAMPLES} samples at micro-batch "
                         f"{MICRO_BATCH} give at most {MAX_WORKERS} ranks a micro-batch each",
                         value=num_workers, fix=_fewer_workers(largest))
    if not fits(num_workers):
        largest = largest_fitting(fits, num_workers - 1)
        check_plan(plans[num_workers], force=False, fixes=(_fewer_workers(largest),))
    return plans[num_workers]


def _fewer_workers(largest: int) -> str:
    if largest < 1:
        return "free memory on this machine: it plans no rank of the demo (see the arithmetic)"
    return (f"pass --workers {largest} or fewer (each rank plans against this machine's RAM "
            f"divided by --workers)")


def run_demo(*, num_workers: int = 2, epochs: int = 12, rehearse: bool = True,
             straggler_delay_s: float = 0.03, namespace: str = DEFAULT_NAMESPACE,
             out: TextIO = sys.stdout) -> RunSummary:
    """Plan (refusing what cannot run, before Ray starts), start a local Ray cluster, run the
    guarded toy training, print progress and summary; Ray Train's storage is removed after."""
    started = time.monotonic()
    total = demo_steps(num_workers, epochs)
    toy = load_toy()
    config = demo_config(toy, epochs=epochs, rehearse=rehearse,
                         straggler_delay_s=straggler_delay_s)
    plan = plan_demo(config, num_workers)
    out.write(f"raytrain-guard demo: {num_workers} gloo workers on a local Ray cluster, "
              f"{total} steps" + (f"; rehearsing a GPU at {REHEARSED_GPU_FRAC:.0%} memory "
                                  f"(scripted probe) and a {straggler_delay_s * 1000:.0f} ms "
                                  "straggler on rank 1" if rehearse else "") + "\n")
    out.flush()
    import ray

    ray.init(address="local", namespace=namespace, num_cpus=max(4, num_workers + 2),
             include_dashboard=False, log_to_driver=False, logging_level="error")
    storage = tempfile.mkdtemp(prefix="rtg-demo-")
    try:
        summary = launch(config, num_workers=num_workers, config=GuardConfig(), plan=plan,
                         namespace=namespace, storage_path=storage,
                         probe_factory=rehearsal_probes() if rehearse else None,
                         progress=ProgressPrinter(out, total, started), progress_interval_s=1.0)
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    if out.isatty():
        out.write("\n")
    out.write(summary.format() + "\n")
    out.write(f"(demo took {time.monotonic() - started:.0f} s)\n")
    return summary

