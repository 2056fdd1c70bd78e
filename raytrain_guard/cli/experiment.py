"""``raytrain-guard experiment`` and ``raytrain-guard demo``: the same training with the guard
observing and acting, under the same injected faults. Exit 0 when it ran (the demo: when it
showed its outcome), 1 when it could not run, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from raytrain_guard.cli.args import EXIT_DOES_NOT_FIT, EXIT_OK, positive_int, size
from raytrain_guard.errors import InputError, check_int, one_line
from raytrain_guard.experiment import demo, faults, report, runner

_FACTORY_FLAGS = (("--model", "model_factory"), ("--dataset", "dataset_factory"),
                  ("--optimizer", "optimizer_factory"), ("--loss", "loss_fn"))


def add_experiment_command(subparsers) -> None:
    """``raytrain-guard experiment``: the same training with the guard observing and acting."""
    p = subparsers.add_parser(
        "experiment", help="train twice under the same injected faults, guard observing and "
                           "guard acting, and compare them side by side",
        description="Run the same training once per arm (--repeat N: N pairs, interleaved) "
                    "on a local Ray cluster it starts, or on the cluster at --address (else "
                    "RAY_ADDRESS): same seed, data order and fault schedule. 'observe' "
                    "measures and decides but applies nothing; 'act' is the guard as shipped. "
                    "Writes report.md, result.json and timeline.png to --out. Exit 0 when "
                    "every arm ran (whatever it did), 2 bad input, 1 when the experiment could "
                    "not run.")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="KIND:key=value,... e.g. slow_compute:rank=1,start=25,factor=2.5 (or "
                        "node=K instead of rank: every rank of node K); kinds: "
                        "comm_delay, slow_compute, slow_data, memory_growth, activation_spike, "
                        "host_memory, crash, hang (repeat the flag for several)")
    p.add_argument("--arms", default="observe,act", help="arms to run, in order")
    p.add_argument("--workers", type=int, default=2, help="training workers")
    p.add_argument("--nodes", type=int, default=1,
                   help="Ray nodes to start on this machine, each with its own node id, "
                        "monitor and CPUs; the workers spread over them (faults take node=K)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs (default 1)")
    length.add_argument("--steps", type=int, default=None, help="steps (instead of epochs)")
    p.add_argument("--seed", type=int, default=0,
                   help="the seed of the first pair of arms; pair i runs at seed + i")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="pairs of arms to run, interleaved (observe, act, observe, act, ...), "
                        "each in <out>/repeat-<i>/; the report gives each figure's median and "
                        "95 %% bootstrap interval over them (default 1: one run of each arm, "
                        "in <out>/<arm>)")
    p.add_argument("--address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to run on (e.g. 10.0.0.1:6379 or auto), as "
                        "ray.init(address=...) takes it; default RAY_ADDRESS, else a local "
                        "cluster the experiment starts and stops. On several nodes, --out must "
                        "be a folder every node sees")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="each rank's card: simulated on CPU, a cap on CUDA (default for the "
                        "built-in model: 10MiB)")
    p.add_argument("--node-memory", default=None, metavar="SIZE",
                   help="host RAM of each Ray node the experiment starts: its processes in a "
                        "memory cgroup of SIZE, whose kernel OOM killer acts on that node "
                        "alone, as on separate hosts (root, cgroup v1; e.g. 4GiB)")
    p.add_argument("--device-step-ms", type=float, default=None, metavar="MS",
                   help="device time per micro-batch that the host waits out in forward and "
                        "backward, as beside a GPU (default for the built-in model: 50; 0: the "
                        "model's real compute only; slow_compute stretches it)")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "fsdp-grad-op",
                                                         "fsdp-full"))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    for flag, name in _FACTORY_FLAGS:
        p.add_argument(flag, default=None, metavar="M:F",
                       help=f"your {name} as module:attr (all four together, or none for the "
                            "built-in sequence model)")
    p.add_argument("--num-samples", type=int, default=None,
                   help="your dataset's size, for the exactly-once audit of sample ids")
    p.add_argument("--max-failures", type=int, default=2,
                   help="Ray's FailureConfig(max_failures) for each arm")
    p.add_argument("--collective-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="the process group's timeout (Ray's default is 1800 s)")
    p.add_argument("--out", default=None, help="report folder (default: a new one here)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(run=run_experiment)


def experiment_setup(args: argparse.Namespace) -> Any:
    """The :class:`ExperimentSetup` of the command line; InputError for bad input."""
    workers = positive_int(args.workers, "--workers")
    nodes = positive_int(args.nodes, "--nodes")
    parsed = tuple(faults.parse_fault(spec, world_size=workers, num_nodes=nodes)
                   for spec in args.fault)
    given = {name: getattr(args, flag[2:]) for flag, name in _FACTORY_FLAGS
             if getattr(args, flag[2:]) is not None}
    if given and len(given) != len(_FACTORY_FLAGS):
        missing = [flag for flag, name in _FACTORY_FLAGS if name not in given]
        raise InputError(missing[0], "your own job needs all four factories",
                         fix="pass " + " ".join(f"{f} M:F" for f in missing)
                             + ", or none for the built-in model")
    for name in ("micro_batch", "grad_accum"):
        positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    check_int("--max-failures", args.max_failures, fix="e.g. --max-failures 2")
    if not args.collective_timeout > 0:
        raise InputError("--collective-timeout", "must be > 0", value=args.collective_timeout,
                         fix="e.g. --collective-timeout 120")
    return runner.ExperimentSetup(
        faults=parsed, arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        num_workers=workers, nodes=nodes,
        epochs=positive_int(args.epochs, "--epochs") if args.epochs is not None else 1,
        max_steps=positive_int(args.steps, "--steps") if args.steps is not None else None,
        seed=args.seed, strategy=args.strategy, repeat=positive_int(args.repeat, "--repeat"),
        device_memory_bytes=size(args.device_memory, "--device-memory")
        if args.device_memory else None,
        device_step_ms=args.device_step_ms,
        node_memory_bytes=size(args.node_memory, "--node-memory") if args.node_memory else None,
        micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        factories=given or dict(runner.BUILT_IN), num_samples=args.num_samples,
        max_failures=args.max_failures, collective_timeout_s=args.collective_timeout)


def run_experiment(args: argparse.Namespace) -> int:
    setup = experiment_setup(args)
    setup.check()
    # absolute here, before any worker sees it (the runner does so too, for the Python API)
    out = os.path.abspath(args.out or time.strftime("raytrain-guard-experiment-%Y%m%d-%H%M%S"))
    progress = None if args.json else (lambda line: print(line, flush=True))
    try:
        # with --json, stdout carries the one object: what Ray prints goes to stderr meanwhile
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            result = runner.run_experiment(setup, out, progress=progress, address=args.address)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the experiment itself could not run: exit 1
        print(f"raytrain-guard experiment: could not run: {one_line(exc)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(report.format_text(result))
        print(f"report: {result['report']}")
    return EXIT_OK


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 points at stderr inside the block (Python's and C's writes alike)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def add_demo_command(subparsers) -> None:
    """``raytrain-guard demo``: a short default experiment on an embedded local Ray cluster."""
    p = subparsers.add_parser(
        "demo", help="a short experiment: the guard observing vs acting under a few faults "
                     "(about a minute)",
        description="Start a local Ray cluster and run the same 2-worker training of the "
                    "built-in sequence model twice under the same faults (a slowed rank, then "
                    "a stretch of long sequences that overflows its card): once with the guard "
                    "observing only, once acting. Prints the side-by-side table and the "
                    "report's path. Exit 0 when it showed its outcome (act finishes every "
                    "step, audited; observe does not; the slowed rank is named), 1 when it "
                    "did not or could not run.")
    p.add_argument("--out", default=None, help="report folder (default: a new one here)")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    try:
        result = demo.run_demo(out_dir=args.out)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the demo could not run (e.g. no traces): exit 1
        print(f"raytrain-guard demo: could not run: {one_line(exc)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if result["shortfalls"]:
        print("raytrain-guard demo: failed: " + "; ".join(result["shortfalls"]), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_OK
