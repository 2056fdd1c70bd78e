"""``raytrain-guard plan``: will the job fit, and with which settings (exit 0 fits, 1 does not
fit, 2 bad input). The inputs come from :mod:`raytrain_guard.cli.sources`; the arithmetic is the
planner's (:func:`raytrain_guard.planner.plan.plan`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

from raytrain_guard.cli.args import EXIT_DOES_NOT_FIT, EXIT_OK, positive_int, size
from raytrain_guard.cli.sources import (
    curve,
    data_source,
    gpu_memory,
    local_gpus,
    machine_memory,
    model_source,
    plan_config,
)
from raytrain_guard.errors import InputError, PlanInputError
from raytrain_guard.planner.memory_model import DEFAULT_FSDP_UNIT_FRAC, TrainingSetup
from raytrain_guard.planner.plan import plan
from raytrain_guard.units import format_bytes


def add_plan_command(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="capacity plan: does it fit, largest micro-batch, buckets, DataLoader",
        description="Plan a data-parallel training job: per-GPU memory against the headroom "
                    "rule, the largest micro-batch, gradient accumulation, DDP bucket_cap_mb and "
                    "DataLoader sizing. Exit 0 fits, 1 does not fit, 2 bad input.")
    src = p.add_argument_group("model (one of: --params, --model with --sample, or the shape)")
    src.add_argument("--params", help="parameter count, e.g. 7.5B or 7.5e9")
    src.add_argument("--activation-bytes-per-sample", metavar="SIZE",
                     help="with --params: activation bytes per sample at the peak (e.g. 1.5GiB)")
    src.add_argument("--model", metavar="MODULE:FACTORY", help="factory returning the nn.Module")
    src.add_argument("--sample", metavar="MODULE:FACTORY",
                     help="factory returning one batch (with --model; also measures batch bytes)")
    src.add_argument("--loss", metavar="MODULE:FN",
                     help="fn(model, batch) -> scalar loss (default: sum of the output)")
    src.add_argument("--dataset", metavar="MODULE:FACTORY",
                     help="factory returning the training Dataset: batch bytes measured from its "
                          "samples, and a warning when it keeps samples in Python lists")
    for flag in ("--layers", "--hidden", "--heads", "--seq-len", "--vocab"):
        src.add_argument(flag, metavar="N", help="transformer shape")
    src.add_argument("--ffn-hidden", metavar="N", help="MLP hidden size (default 4 x hidden)")
    src.add_argument("--kv-heads", metavar="N", help="key/value heads (grouped-query attention)")
    src.add_argument("--gated-mlp", action="store_true", help="SwiGLU MLP (Llama-style)")
    src.add_argument("--tied-embeddings", action="store_true", help="output head shares the "
                     "embedding")
    src.add_argument("--dropout", action="store_true", help="the model uses dropout")
    src.add_argument("--no-bias", action="store_true",
                     help="linear layers without biases (Llama); the norms default to RMSNorm")
    src.add_argument("--norm", help="layernorm (default with biases) or rmsnorm (default with "
                     "--no-bias: eager Llama-style, an fp32 copy of each norm's input)")
    src.add_argument("--no-expand-kv", action="store_true",
                     help="grouped-query K/V reach attention at their own width (SDPA "
                          "enable_gqa=True); default: expanded to every head (repeat_kv)")

    run = p.add_argument_group("training")
    run.add_argument("--micro-batch", metavar="N",
                     help="samples per rank per step (default: the largest that fits)")
    run.add_argument("--global-batch", metavar="N", help="samples per optimizer step, all ranks")
    run.add_argument("--grad-accum", metavar="N", help="micro-steps per optimizer step")
    run.add_argument("--strategy", default="ddp", help="ddp, zero1, fsdp-grad-op, fsdp-full")
    run.add_argument("--precision", default="fp32", help="fp32, amp-bf16, bf16-master, bf16. "
                     "Under FSDP, bf16-master is FSDP2's MixedPrecisionPolicy(param_dtype=bf16, "
                     "reduce_dtype=fp32): fp32 sharded master weights and gradients, bf16 "
                     "gathered parameters, fp32 reduce-scatter")
    run.add_argument("--optimizer", default="adamw", help="sgd, sgd-momentum, adam, adamw")
    run.add_argument("--recompute", help="none (default); selective (Megatron: only the "
                     "seq x seq attention scores, a no-op with flash attention); per-op (PyTorch "
                     "per-op selective checkpointing, torchtitan's policy: every other matmul "
                     "and SDPA saved); full. With the model shape only (--layers ...)")
    run.add_argument("--attention", help="flash (default), math; with the model shape only")
    run.add_argument("--workers", default="1", metavar="N", help="data-parallel ranks in total")
    run.add_argument("--fsdp-grad-sync", default="auto",
                     help="FSDP with gradient accumulation: every_micro_batch (reduce-scatter "
                          "each micro-batch: gradients stay sharded, more communication), "
                          "last_micro_batch (no sync until the last: unsharded gradients held, "
                          "less communication) or auto (default: the mode that fits the larger "
                          "micro-batch, the less communication on a tie)")
    run.add_argument("--fsdp-unit-params", metavar="N",
                     help="with --params: parameters of the largest FSDP unit (default: 1/8 of "
                          "the model, with a warning; the shape and --model know their units)")

    mach = p.add_argument_group("machine")
    mach.add_argument("--gpus-per-node", metavar="N",
                      help="GPUs (ranks) per node (default: GPUs on this machine, else 1)")
    mach.add_argument("--gpu-mem", metavar="SIZE",
                      help="memory of one GPU, e.g. 80GiB (required without CUDA)")
    mach.add_argument("--host-mem", metavar="SIZE", help="RAM of one node (default: this machine)")
    mach.add_argument("--cpus-per-node", metavar="N",
                      help="CPU cores of one node (default: this machine)")
    mach.add_argument("--batch-bytes", metavar="SIZE",
                      help="bytes of one loader batch at the planned micro-batch")
    mach.add_argument("--no-pin-memory", action="store_true",
                      help="the DataLoader does not pin batches (no pinned copies counted)")
    mach.add_argument("--bandwidth-curve", metavar="FILE.json",
                      help="measured allreduce curve: [[message bytes, seconds], ...]")

    out = p.add_argument_group("output and thresholds")
    out.add_argument("--headroom", metavar="FRAC",
                     help="device memory kept free, 0.15 or 15%% (default from the config)")
    out.add_argument("--fragmentation", metavar="FRAC",
                     help="caching-allocator reserve as a fraction of the tensor peak (default "
                          "from the config, fragmentation_frac). At the default, torchtitan's "
                          "published Llama 3.1 8B FSDP2 runs are predicted about 6 %% under "
                          "(docs/benchmarks.md)")
    out.add_argument("--config", metavar="FILE.toml", help="GuardConfig TOML file")
    out.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(run=run_plan)


#: planner and model fields -> the plan flags that set them, so that an error the planner
#: raises names what the user typed (``batch_bytes`` -> ``--batch-bytes``)
PLAN_FLAGS = {
    "config": "--config", "device_memory_bytes": "--gpu-mem", "host_memory_bytes": "--host-mem",
    "gpus_per_node": "--gpus-per-node", "cpus_per_node": "--cpus-per-node",
    "global_batch": "--global-batch", "micro_batch": "--micro-batch",
    "grad_accum": "--grad-accum", "world_size": "--workers", "strategy": "--strategy",
    "precision": "--precision", "optimizer": "--optimizer", "recompute": "--recompute",
    "attention": "--attention", "layers": "--layers", "hidden": "--hidden", "heads": "--heads",
    "seq_len": "--seq-len", "vocab": "--vocab", "ffn_hidden": "--ffn-hidden",
    "num_kv_heads": "--kv-heads", "bandwidth_curve": "--bandwidth-curve", "norm": "--norm",
    "fsdp_grad_sync": "--fsdp-grad-sync"}
#: Python spellings in fix texts -> the flag or file that does it on the command line
PLAN_FIX_WORDS = (("pin_memory=False", "--no-pin-memory"),
                  ("host_prefetch_frac", "host_prefetch_frac (--config)"))


def run_plan(args: argparse.Namespace) -> int:
    """Plan from the flags; an input error names the flag (see :data:`PLAN_FLAGS`)."""
    try:
        return _plan_from_flags(args)
    except InputError as err:
        raise _in_flags(err, args) from None


def _in_flags(err: InputError, args: argparse.Namespace) -> InputError:
    """``err`` with its field and fix in the plan's flags (unchanged where none applies)."""
    m = re.fullmatch(r"(\w+)(\[\d+\])?", err.field)     # "bandwidth_curve[3]" too
    name, index = m.groups("") if m else (err.field, "")
    flag = PLAN_FLAGS.get(name)
    if name in ("batch_bytes", "sample_bytes"):   # given, or measured from a factory
        flag = "--batch-bytes" if args.batch_bytes is not None else \
            "--dataset" if args.dataset is not None else "--sample"
    if flag is None:
        return err
    fix = err.fix
    for python, cli in PLAN_FIX_WORDS:
        fix = fix.replace(python, cli)
    return type(err)(f"{flag}{index}", err.problem, value=err.value, fix=fix)


def _plan_from_flags(args: argparse.Namespace) -> int:
    """Build the inputs from the flags, plan, print; exit 0 fits, 1 does not fit."""
    config = plan_config(args)
    world = positive_int(args.workers, "--workers")
    setup = TrainingSetup(strategy=args.strategy, precision=args.precision,
                          optimizer=args.optimizer, world_size=world,
                          micro_batch=positive_int(args.micro_batch, "--micro-batch", 1),
                          grad_accum=positive_int(args.grad_accum, "--grad-accum", 1))
    global_batch = positive_int(args.global_batch, "--global-batch", None)
    if global_batch is not None and args.grad_accum is not None and args.micro_batch is not None:
        reached = setup.micro_batch * setup.grad_accum * world
        if reached != global_batch:
            raise PlanInputError("--global-batch", f"disagrees with --micro-batch x --grad-accum "
                                 f"x --workers = {reached}", value=global_batch,
                                 fix="give two of the three, or make them agree")
    model, activations, extra = model_source(args, setup)
    batch_bytes, sample_bytes, list_backed, data_notes = data_source(args, config)
    device_mem = gpu_memory(args)
    host_mem = size(args.host_mem, "--host-mem") or machine_memory()
    cpus = positive_int(args.cpus_per_node, "--cpus-per-node", None) or os.cpu_count()
    gpus = positive_int(args.gpus_per_node, "--gpus-per-node", None) or local_gpus()
    result = plan(model=model, activations=activations, setup=setup,
                  device_memory_bytes=device_mem, host_memory_bytes=host_mem,
                  cpus_per_node=cpus, gpus_per_node=gpus, global_batch=global_batch,
                  batch_bytes=batch_bytes, sample_bytes=sample_bytes,
                  list_backed_dataset=list_backed, bandwidth_curve=curve(args),
                  config=config, auto_micro_batch=args.micro_batch is None,
                  pin_memory=not args.no_pin_memory,
                  fsdp_grad_sync=args.fsdp_grad_sync or "auto")
    data = result.to_dict()
    data.update(warnings=list(_unit_warnings(args, model, setup)) + data["warnings"],
                num_params=model.num_params, num_trainable_params=model.num_trainable_params,
                gpus_per_node=gpus, notes=list(extra) + list(data_notes) + data["notes"])
    print(json.dumps(data, indent=2) if args.json else format_plan(data))
    return EXIT_OK if result.fits else EXIT_DOES_NOT_FIT


def format_plan(d: dict[str, Any]) -> str:
    """The human table of a plan dict (``Plan.to_dict()`` plus the CLI's model facts)."""
    rows: list[tuple[str, str]] = []
    verdict = "FITS" if d["fits"] else "DOES NOT FIT"
    rows.append(("verdict", f"{verdict}: {d['arithmetic']}"))
    rows.append(("model", (f"{format_count(d['num_params'])} parameters "
                           f"({format_count(d['num_trainable_params'])} trainable), "
                           f"activations {d['activations_source']}")))
    rows.append(("setup", (f"{d['strategy']}, {d['precision']}, {d['optimizer']}, "
                           f"{d['world_size']} ranks ({d['gpus_per_node']} per node)")))
    for key in ("params", "buffers", "grads", "optimizer", "activations", "temp", "comm",
                "reserve"):
        if key in d["breakdown"]:
            rows.append((f"  {key}", format_bytes(d["breakdown"][key])))
    rows.append(("  peak phase", d["peak_phase"]))
    rows.append(("free in budget", format_bytes(d["free_bytes"])))
    largest = "no limit derived" if d["max_micro_batch"] is None else d["max_micro_batch"]
    rows.append(("micro_batch", f"{d['micro_batch']} (largest that fits: {largest})"))
    rows.append(("grad_accum", (f"{d['grad_accum']} -> global batch {d['global_batch']} = "
                               f"{d['micro_batch']} x {d['grad_accum']} x {d['world_size']}")))
    options = sorted(d.get("fsdp_grad_sync_options") or (), key=lambda o: not o["chosen"])
    for option in options:
        largest_mb = option["max_micro_batch"]
        mark = "chosen" if option["chosen"] else "other"
        rows.append(("fsdp_grad_sync" if option["chosen"] else "",
                     (f"{option['fsdp_grad_sync']} ({mark}): largest micro-batch "
                     f"{'no limit' if largest_mb is None else largest_mb}, "
                     f"{format_bytes(option['total_bytes'])} at {option['micro_batch']} x "
                     f"{option['grad_accum']} (grads {format_bytes(option['grads_bytes'])}), "
                     f"{format_bytes(option['comm_bytes_per_step'])} through the collectives "
                     f"per step")))
    if d["bucket"] is not None:
        rows.append(("bucket_cap_mb", d["bucket"]["reason"]))
    elif d["world_size"] == 1 and d["strategy"] in ("ddp", "zero1"):
        rows.append(("bucket_cap_mb",
                     "none (world size 1: Ray's prepare_model does not wrap DDP)"))
    else:
        rows.append(("bucket_cap_mb", "n/a"))
    loader = d["dataloader"]
    rows.append(("DataLoader", "not sized" if loader is None else (
        f"num_workers {loader['num_workers']}, prefetch_factor {loader['prefetch_factor']}: "
        f"{loader['reason']}")))
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k:<{width}}{v}" for k, v in rows]
    for key in ("warnings", "notes"):
        if d[key]:
            lines.append(f"{key}:")
            lines.extend(f"  - {item}" for item in d[key])
    return "\n".join(lines)


def _unit_warnings(args, model, setup) -> tuple[str, ...]:
    """The FSDP unit assumed for a plan from ``--params`` alone, said once."""
    if args.params is None or args.fsdp_unit_params is not None or \
            setup.strategy.value not in ("fsdp-full", "fsdp-grad-op"):
        return ()
    return ((f"FSDP unit size unknown (--params alone): assumed the largest unit holds "
            f"1/{round(1 / DEFAULT_FSDP_UNIT_FRAC)} of the parameters "
            f"({format_count(model.largest_unit_params)}); give --fsdp-unit-params N, or the "
            f"shape (--layers ...)"),)


def format_count(n: int) -> str:
    """``7_500_000_000 -> "7.50 B"``, ``941_056 -> "941.06 K"``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return str(n)
