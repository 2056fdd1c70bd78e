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
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import tempfile
import time
from typing import Any, Mapping, TextIO

from raytrain_guard.cluster.launcher import DEFAULT_NAMESPACE, RunSummary, launch, progress_line
from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError
from raytrain_guard.units import GiB

REHEARSED_GPU_FRAC = 0.89


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
        "dataset_factory": functools.partial(toy.make_dataset, 256),
        "optimizer_factory": toy.make_optimizer, "loss_fn": toy.loss_fn,
        "micro_batch": 8, "grad_accum": 1, "epochs": epochs, "num_workers": 0,
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


def run_demo(*, num_workers: int = 2, epochs: int = 12, rehearse: bool = True,
             straggler_delay_s: float = 0.03, namespace: str = DEFAULT_NAMESPACE,
             out: TextIO = sys.stdout) -> RunSummary:
    """Start a local Ray cluster, run the guarded toy training, print progress and summary."""
    import ray

    toy = load_toy()
    config = demo_config(toy, epochs=epochs, rehearse=rehearse,
                         straggler_delay_s=straggler_delay_s)
    total = 256 // (8 * num_workers) * epochs
    tty = out.isatty()
    started = time.monotonic()

    last = [""]

    def show(status: Mapping[str, Any]) -> None:
        line = progress_line(status, total, started)
        if not tty:  # a log gets a line only when something besides the clock changed
            key = line.rsplit("|", 1)[0]
            if key == last[0]:
                return
            last[0] = key
        out.write(("\r" + line.ljust(100)) if tty else line + "\n")
        out.flush()

    out.write(f"raytrain-guard demo: {num_workers} gloo workers on a local Ray cluster, "
              f"{total} steps" + ("; rehearsing a GPU at 89% memory (scripted probe) and a "
                                  f"{straggler_delay_s * 1000:.0f} ms straggler on rank 1"
                                  if rehearse else "") + "\n")
    out.flush()
    ray.init(address="local", namespace=namespace, num_cpus=max(4, num_workers + 2),
             include_dashboard=False, log_to_driver=False, logging_level="error")
    try:
        summary = launch(config, num_workers=num_workers, config=GuardConfig(),
                         namespace=namespace, storage_path=tempfile.mkdtemp(prefix="rtg-demo-"),
                         probe_factory=rehearsal_probes() if rehearse else None,
                         progress=show, progress_interval_s=1.0)
    finally:
        ray.shutdown()
    if tty:
        out.write("\n")
    out.write(summary.format() + "\n")
    out.write(f"(demo took {time.monotonic() - started:.0f} s)\n")
    return summary
