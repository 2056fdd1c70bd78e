"""The ``raytrain-guard`` command line.

Each subcommand is one ``add_<name>_command(subparsers)`` function that adds its parser and sets
``run=<function(args) -> exit code>``; :data:`COMMANDS` lists them. Adding a subcommand is one
new function and one entry in that tuple.

Exit codes: 0 success (for ``plan``: the plan fits), 1 the plan does not fit, 2 bad input
(one line on stderr naming the input and the fix; argparse's own errors too, see
:class:`OneLineArgumentParser`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import GuardError, InputError, PlanInputError, check_int
from raytrain_guard.units import MiB, TiB, format_bytes, parse_bytes, parse_count

log = logging.getLogger(__name__)

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2

#: sizes written without a unit below this are refused: "--gpu-mem 80" meant GiB, not bytes
MIN_UNITLESS_BYTES = MiB
#: no memory a plan reads (a card, a node's RAM, a batch) comes near 1 PiB: "1e40" is a typo
MAX_SIZE_BYTES = 1024 * TiB
#: --params above this is no model: 1000 T parameters, hundreds of times the largest trained
MAX_PARAMS = 1e15


# -- plan ----------------------------------------------------------------------------------------

def add_plan_command(subparsers) -> None:
    """``raytrain-guard plan``: will the job fit, and with which settings."""
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
    from raytrain_guard.core.memory_model import TrainingSetup
    from raytrain_guard.core.planner import plan

    config = _config(args)
    world = _positive_int(args.workers, "--workers")
    setup = TrainingSetup(strategy=args.strategy, precision=args.precision,
                          optimizer=args.optimizer, world_size=world,
                          micro_batch=_positive_int(args.micro_batch, "--micro-batch", 1),
                          grad_accum=_positive_int(args.grad_accum, "--grad-accum", 1))
    global_batch = _positive_int(args.global_batch, "--global-batch", None)
    if global_batch is not None and args.grad_accum is not None and args.micro_batch is not None:
        reached = setup.micro_batch * setup.grad_accum * world
        if reached != global_batch:
            raise PlanInputError("--global-batch", f"disagrees with --micro-batch x --grad-accum "
                                 f"x --workers = {reached}", value=global_batch,
                                 fix="give two of the three, or make them agree")
    model, activations, extra = _model_source(args, setup)
    batch_bytes, sample_bytes, list_backed, data_notes = _data_source(args, config)
    device_mem = _gpu_memory(args)
    host_mem = _size(args.host_mem, "--host-mem") or _host_memory()
    cpus = _positive_int(args.cpus_per_node, "--cpus-per-node", None) or os.cpu_count()
    gpus = _positive_int(args.gpus_per_node, "--gpus-per-node", None) or _local_gpus()
    result = plan(model=model, activations=activations, setup=setup,
                  device_memory_bytes=device_mem, host_memory_bytes=host_mem,
                  cpus_per_node=cpus, gpus_per_node=gpus, global_batch=global_batch,
                  batch_bytes=batch_bytes, sample_bytes=sample_bytes,
                  list_backed_dataset=list_backed, bandwidth_curve=_curve(args),
                  config=config, auto_micro_batch=args.micro_batch is None,
                  pin_memory=not args.no_pin_memory,
                  fsdp_grad_sync=getattr(args, "fsdp_grad_sync", None) or "auto")
    data = result.to_dict()
    data["warnings"] = list(_unit_warnings(args, model, setup)) + data["warnings"]
    data["num_params"] = model.num_params
    data["num_trainable_params"] = model.num_trainable_params
    data["gpus_per_node"] = gpus
    data["notes"] = list(extra) + list(data_notes) + data["notes"]
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=False))
    else:
        print(format_plan(data))
    return EXIT_OK if result.fits else EXIT_DOES_NOT_FIT


def format_plan(d: dict[str, Any]) -> str:
    """The human table of a plan dict (``Plan.to_dict()`` plus the CLI's model facts)."""
    rows: list[tuple[str, str]] = []
    verdict = "FITS" if d["fits"] else "DOES NOT FIT"
    rows.append(("verdict", f"{verdict}: {d['arithmetic']}"))
    rows.append(("model", (f"{_format_count(d['num_params'])} parameters "
                           f"({_format_count(d['num_trainable_params'])} trainable), "
                           f"activations {d['activations_source']}")))
    rows.append(("setup", (f"{d['strategy']}, {d['precision']}, {d['optimizer']}, "
                           f"{d['world_size']} ranks ({d['gpus_per_node']} per node)")))
    for key in ("params", "buffers", "grads", "optimizer", "activations", "temp", "comm",
                "reserve"):
        if key in d["breakdown"]:
            rows.append((f"  {key}", format_bytes(d["breakdown"][key])))
    rows.append(("  peak phase", d["peak_phase"]))
    rows.append(("free in budget", format_bytes(d["free_bytes"])))
    largest = d["max_micro_batch"]
    largest_txt = "no limit derived" if largest is None else str(largest)
    rows.append(("micro_batch", f"{d['micro_batch']} (largest that fits: {largest_txt})"))
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
    if loader is not None:
        rows.append(("DataLoader", (f"num_workers {loader['num_workers']}, prefetch_factor "
                                   f"{loader['prefetch_factor']}: {loader['reason']}")))
    else:
        rows.append(("DataLoader", "not sized"))
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k:<{width}}{v}" for k, v in rows]
    for title, key in (("warnings", "warnings"), ("notes", "notes")):
        if d[key]:
            lines.append(f"{title}:")
            lines.extend(f"  - {item}" for item in d[key])
    return "\n".join(lines)


def _format_count(n: int) -> str:
    """``7_500_000_000 -> "7.50 B"``, ``941_056 -> "941.06 K"``."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {suffix}"
    return str(n)


# -- plan: inputs --------------------------------------------------------------------------------

def _model_source(args, setup) -> tuple[Any, Any, tuple[str, ...]]:
    """(ModelStats, ActivationProfile, notes) from exactly one of the three model sources."""
    from raytrain_guard.core.model_stats import ActivationProfile, ModelStats

    shape_flags = [args.layers, args.hidden, args.heads, args.seq_len, args.vocab]
    given = [name for name, on in (("--params", args.params is not None),
                                   ("--model", args.model is not None),
                                   ("--layers/--hidden/...", any(f is not None
                                                                 for f in shape_flags)))
             if on]
    if len(given) != 1:
        raise PlanInputError("model", "give exactly one model source" + (
            f", got {' and '.join(given)}" if given else ""),
            fix="use --params 7B, or --model m:f --sample m:g, or --layers --hidden --heads "
                "--seq-len --vocab")
    if args.activation_bytes_per_sample is not None and args.params is None:
        raise PlanInputError("--activation-bytes-per-sample", "only applies with --params",
                             value=args.activation_bytes_per_sample,
                             fix="drop it: the shape or the trace gives the activations")
    for flag, value in (("--recompute", args.recompute), ("--attention", args.attention),
                        ("--norm", args.norm)):
        if value is not None and (args.params is not None or args.model is not None):
            source = "--params" if args.params is not None else "--model"
            raise PlanInputError(flag, f"only applies with the model shape (--layers "
                                 f"--hidden ...), not with {source}", value=value,
                                 fix="drop it: " + (
                                     "give --activation-bytes-per-sample as measured with it"
                                     if source == "--params" else
                                     "the trace measures the model as its factory builds it"))
    unit_flag = getattr(args, "fsdp_unit_params", None)
    if unit_flag is not None and args.params is None:
        raise PlanInputError("--fsdp-unit-params", "only applies with --params", value=unit_flag,
                             fix="drop it: the shape and the trace know the model's FSDP units")
    if args.params is not None:
        n = parse_count(args.params, field="--params", at_most=MAX_PARAMS)
        model = ModelStats(num_params=n, num_trainable_params=n,
                           largest_unit_params=_unit_params(unit_flag, n))
        if args.activation_bytes_per_sample is None:
            return model, ActivationProfile(0.0, source="unknown"), ()
        per_sample = _size(args.activation_bytes_per_sample, "--activation-bytes-per-sample")
        return model, ActivationProfile(float(per_sample), source="given"), ()
    if args.model is not None:
        if args.sample is None:
            raise PlanInputError("--sample", "is required with --model", fix="pass --sample "
                                 "MODULE:FACTORY returning one batch")
        from raytrain_guard.trace import trace_model

        _import_path()
        traced = trace_model(args.model, args.sample, loss=args.loss,
                             precision=setup.precision, optimizer=setup.optimizer)
        notes = ((f"traced {args.model} in {traced.trace_s:.1f} s ({traced.mode} device), "
                 f"loss: {traced.loss}"),) + traced.warnings
        return traced.model_stats, traced.activations, notes
    missing = [f"--{n.replace('_', '-')}" for n, v in zip(
        ("layers", "hidden", "heads", "seq_len", "vocab"), shape_flags) if v is None]
    if missing:
        raise PlanInputError(missing[0], "is required with the other shape flags",
                             fix="give all of --layers --hidden --heads --seq-len --vocab")
    from raytrain_guard.core.activations import analytic_transformer

    options = {"gated_mlp": args.gated_mlp, "tied_embeddings": args.tied_embeddings,
               "dropout": args.dropout, "bias": not args.no_bias,
               "expand_kv": not args.no_expand_kv}
    if args.norm is not None:
        options["norm"] = args.norm
    if args.ffn_hidden is not None:
        options["ffn_hidden"] = _positive_int(args.ffn_hidden, "--ffn-hidden")
    if args.kv_heads is not None:
        options["num_kv_heads"] = _positive_int(args.kv_heads, "--kv-heads")
    model, acts = analytic_transformer(
        layers=_positive_int(args.layers, "--layers"), hidden=_positive_int(args.hidden,
                                                                          "--hidden"),
        heads=_positive_int(args.heads, "--heads"), seq_len=_positive_int(args.seq_len,
                                                                          "--seq-len"),
        vocab=_positive_int(args.vocab, "--vocab"), precision=setup.precision,
        recompute=args.recompute or "none", attention=args.attention or "flash", **options)
    return model, acts, acts.notes


def _unit_params(text, num_params: int) -> int:
    """``--fsdp-unit-params``, or the core's default share of ``num_params``."""
    from raytrain_guard.core.memory_model import default_fsdp_unit_params

    if text is None:
        return default_fsdp_unit_params(num_params)
    unit = parse_count(text, field="--fsdp-unit-params", at_most=MAX_PARAMS)
    if not 0 < unit <= num_params:
        raise PlanInputError("--fsdp-unit-params", f"must be between 1 and --params "
                             f"({num_params})", value=text,
                             fix="give the parameters of the largest FSDP unit (one block, or "
                                 "the embedding and head)")
    return unit


def _unit_warnings(args, model, setup) -> tuple[str, ...]:
    """The FSDP unit assumed for a plan from ``--params`` alone, said once."""
    if args.params is None or getattr(args, "fsdp_unit_params", None) is not None or \
            setup.strategy.value not in ("fsdp-full", "fsdp-grad-op"):
        return ()
    from raytrain_guard.core.memory_model import DEFAULT_FSDP_UNIT_FRAC

    return ((f"FSDP unit size unknown (--params alone): assumed the largest unit holds "
            f"1/{round(1 / DEFAULT_FSDP_UNIT_FRAC)} of the parameters "
            f"({_format_count(model.largest_unit_params)}); give --fsdp-unit-params N, or the "
            f"shape (--layers ...)"),)


def _data_source(args, config) -> tuple[int | None, float | None, bool, tuple[str, ...]]:
    """(batch_bytes, sample_bytes, list_backed, notes) from --batch-bytes, --dataset, --sample.
    Only a measured batch imports torch (batch_inspect): a plan from sizes alone takes ~0.2 s."""
    if args.batch_bytes is not None:
        return _size(args.batch_bytes, "--batch-bytes"), None, False, ()
    if args.dataset is None and args.sample is None:
        return None, None, False, ()
    from raytrain_guard import batch_inspect

    _import_path()
    from raytrain_guard.factories import load_object

    if args.dataset is not None:
        factory = load_object(args.dataset, field_name="--dataset", error=PlanInputError)
        dataset = _call_user(factory, "--dataset")
        measured = batch_inspect.measure_dataset(dataset, config=config)
        found = batch_inspect.list_backed_attributes(
            dataset, min_items=config.list_dataset_min_items)
        note = (f"batch bytes from {measured.batch_size} samples of --dataset: "
                f"{format_bytes(measured.bytes_per_sample)} per sample")
        if found:
            note += f"; Python containers in the dataset: {', '.join(found)}"
        return None, measured.bytes_per_sample, bool(found), (note,)
    factory = load_object(args.sample, field_name="--sample", error=PlanInputError)
    measured = batch_inspect.measure_batch(_call_user(factory, "--sample"))
    note = (f"batch bytes from --sample: {format_bytes(measured.batch_bytes)} for "
            f"{measured.batch_size or 1} samples")
    return None, measured.bytes_per_sample, False, (note,)


def _call_user(factory: Callable[[], Any], flag: str) -> Any:
    try:
        return factory()
    except GuardError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory raised
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise PlanInputError(flag, f"the factory raised {type(exc).__name__}: {first}",
                             fix="make the factory run on its own (python -c \"from m import "
                                 "f; f()\")") from None


def _import_path() -> None:
    """Let ``MODULE:FACTORY`` name modules of the current directory, as ``python -m`` does."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def _config(args) -> GuardConfig:
    config = GuardConfig.from_toml(args.config) if args.config else GuardConfig()
    for flag, value, field_name, example in (
            ("--headroom", args.headroom, "headroom_frac", "0.15 or 15%"),
            ("--fragmentation", getattr(args, "fragmentation", None), "fragmentation_frac",
             "0.14 or 14%")):
        if value is None:
            continue
        text = str(value).strip()
        try:
            frac = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise PlanInputError(flag, "not a fraction", value=value,
                                 fix=f"write {example}") from None
        try:
            config = config.replace(**{field_name: frac})
        except InputError as err:    # the flag, not the config field it sets
            raise PlanInputError(flag, err.problem, value=value, fix=err.fix) from None
    return config


def _positive_int(text, flag: str, default: Any = ...) -> Any:
    """A flag's text as an integer >= 1; ``default`` when the flag is absent (none: required)."""
    if text is None:
        if default is ...:
            raise PlanInputError(flag, "is required", fix=f"pass {flag} N")
        return default
    return check_int(flag, text, at_least=1, parse=True, error=PlanInputError,
                     fix=f"pass {flag} as a positive integer, e.g. {flag} 8")


def _size(text, flag: str) -> int | None:
    """A size flag: refused without a unit below MIN_UNITLESS_BYTES, and above MAX_SIZE_BYTES."""
    return None if text is None else parse_bytes(text, field=flag,
                                                 unitless_min_bytes=MIN_UNITLESS_BYTES,
                                                 at_most=MAX_SIZE_BYTES)


def _curve(args) -> list[tuple[int, float]] | None:
    if args.bandwidth_curve is None:
        return None
    try:
        with open(args.bandwidth_curve) as fh:
            data = json.load(fh)
        return [(int(size), float(seconds)) for size, seconds in data]
    except (OSError, ValueError, TypeError) as exc:
        raise PlanInputError("--bandwidth-curve", f"cannot read it ({type(exc).__name__})",
                             value=args.bandwidth_curve,
                             fix="write a JSON list of [message bytes, seconds] pairs") from None


# -- machine defaults (lazy imports: the CLI starts without torch or psutil) ---------------------

def _cuda():
    """torch.cuda when a CUDA device is present, else None (imports torch lazily)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _gpu_memory(args) -> int:
    if args.gpu_mem is not None:
        return _size(args.gpu_mem, "--gpu-mem")
    cuda = _cuda()
    if cuda is None:
        raise PlanInputError("--gpu-mem", "is required: no CUDA device on this machine",
                             fix="pass the memory of one GPU, e.g. --gpu-mem 80GiB")
    return int(cuda.get_device_properties(0).total_memory)


def _local_gpus() -> int:
    """GPUs on this machine (NVML, without importing torch), 1 when there are none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return max(1, int(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: plan for one GPU per node
        return 1


def _host_memory() -> int:
    """This machine's RAM as the run may use it (the container's cgroup limit when lower)."""
    from raytrain_guard.host_memory import host_memory

    return host_memory()[0]


# -- status --------------------------------------------------------------------------------------

def add_status_command(subparsers) -> None:
    """``raytrain-guard status``: the live coordinator's view of a running guarded training."""
    p = subparsers.add_parser(
        "status", help="nodes, ranks, memory, step time, stragglers and decisions of a live run",
        description="Read the live coordinator of a guarded run (found by name in the "
                    "namespace). Sets RAY_AUTH_MODE=token when a Ray token exists and the "
                    "variable is unset. Exit 0 success, 2 no cluster at --address (within "
                    "about 15 s), no coordinator or bad input.")
    p.add_argument("--address", default=None, help="host:port of the Ray head (default: a "
                   "cluster started on this machine)")
    p.add_argument("--namespace", default="raytrain_guard", help="the run's Ray namespace")
    p.add_argument("--run-id", default=None, help="which run, when several are live")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    from raytrain_guard.cluster.status import format_status, read_status
    try:
        status = read_status(args.address, args.namespace, args.run_id)
    except ConnectionError as exc:
        print(f"raytrain-guard status: error: --address: cannot connect ({exc}); start the "
              "cluster or pass its address", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return EXIT_OK


# -- experiment and demo --------------------------------------------------------------------------

_FACTORY_FLAGS = (("--model", "model_factory"), ("--dataset", "dataset_factory"),
                  ("--optimizer", "optimizer_factory"), ("--loss", "loss_fn"))


def add_experiment_command(subparsers) -> None:
    """``raytrain-guard experiment``: the same training with the guard observing and acting."""
    p = subparsers.add_parser(
        "experiment", help="train twice under the same injected faults, guard observing and "
                           "guard acting, and compare them side by side",
        description="Run the same training once per arm on a local Ray cluster (or the one "
                    "ray.init() finds): same seed, data order and fault schedule. 'observe' "
                    "measures and decides but applies nothing; 'act' is the guard as shipped. "
                    "Writes report.md and timeline.png to --out. Exit 0 when every arm ran "
                    "(whatever it did), 2 bad input, 1 when the experiment could not run.")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="KIND:key=value,... e.g. slow_compute:rank=1,start=25,factor=2.5; kinds: "
                        "comm_delay, slow_compute, slow_data, memory_growth, activation_spike, "
                        "host_memory, crash, hang (repeat the flag for several)")
    p.add_argument("--arms", default="observe,act", help="arms to run, in order")
    p.add_argument("--workers", type=int, default=2, help="training workers")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs (default 1)")
    length.add_argument("--steps", type=int, default=None, help="steps (instead of epochs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="each rank's card: simulated on CPU, a cap on CUDA (default for the "
                        "built-in model: 10MiB)")
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
    from raytrain_guard.core.faults import parse_fault
    from raytrain_guard.experiment.runner import BUILT_IN, ExperimentSetup

    workers = _positive_int(args.workers, "--workers")
    faults = tuple(parse_fault(spec, world_size=workers) for spec in args.fault)
    given = {name: getattr(args, flag[2:]) for flag, name in _FACTORY_FLAGS
             if getattr(args, flag[2:]) is not None}
    if given and len(given) != len(_FACTORY_FLAGS):
        missing = [flag for flag, name in _FACTORY_FLAGS if name not in given]
        raise InputError(missing[0], "your own job needs all four factories",
                         fix="pass " + " ".join(f"{f} M:F" for f in missing)
                             + ", or none for the built-in model")
    for name in ("micro_batch", "grad_accum"):
        _positive_int(getattr(args, name), "--" + name.replace("_", "-"))
    check_int("--max-failures", args.max_failures, fix="e.g. --max-failures 2")
    if not args.collective_timeout > 0:
        raise InputError("--collective-timeout", "must be > 0", value=args.collective_timeout,
                         fix="e.g. --collective-timeout 120")
    return ExperimentSetup(
        faults=faults, arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        num_workers=workers,
        epochs=_positive_int(args.epochs, "--epochs") if args.epochs is not None else 1,
        max_steps=_positive_int(args.steps, "--steps") if args.steps is not None else None,
        seed=args.seed, strategy=args.strategy,
        device_memory_bytes=_size(args.device_memory, "--device-memory")
        if args.device_memory else None,
        device_step_ms=getattr(args, "device_step_ms", None),
        micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        factories=given or dict(BUILT_IN), num_samples=args.num_samples,
        max_failures=args.max_failures, collective_timeout_s=args.collective_timeout)


def run_experiment(args: argparse.Namespace) -> int:
    from raytrain_guard.experiment.report import format_text
    from raytrain_guard.experiment.runner import run_experiment as experiment

    setup = experiment_setup(args)
    setup.check()
    # absolute here, before any worker sees it (the runner does so too, for the Python API)
    out = os.path.abspath(args.out or time.strftime("raytrain-guard-experiment-%Y%m%d-%H%M%S"))
    progress = None if args.json else (lambda line: print(line, flush=True))
    try:
        # with --json, stdout carries the one object: what Ray prints goes to stderr meanwhile
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            result = experiment(setup, out, progress=progress)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the experiment itself could not run: exit 1
        print(f"raytrain-guard experiment: could not run: {_one_line(exc)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(format_text(result))
        print(f"report: {result['report']}")
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (an exception's message may hold newlines)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


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
    from raytrain_guard.cluster.demo import run_demo as demo
    try:
        result = demo(out_dir=args.out)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the demo could not run (e.g. no traces): exit 1
        print(f"raytrain-guard demo: could not run: {_one_line(exc)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if result["shortfalls"]:
        print("raytrain-guard demo: failed: " + "; ".join(result["shortfalls"]), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_OK


def add_grafana_dashboard_command(subparsers) -> None:
    """``raytrain-guard grafana-dashboard``: the guard's Grafana dashboard, as JSON."""
    p = subparsers.add_parser(
        "grafana-dashboard", help="print the Grafana dashboard of the guard's metrics (JSON)",
        description="Write the Grafana dashboard of the guard's metrics: per-rank step time and "
                    "phases, data wait, memory against the watermark and critical lines, "
                    "straggler scores, decisions (also as annotations), node GPU memory, "
                    "utilization, temperature and throttle reasons. Import it into the Grafana "
                    "of Ray's metrics setup (Dashboards > New > Import), or copy it into the "
                    "folder that Grafana provisions from (on the head: "
                    "/tmp/ray/session_latest/metrics/grafana/dashboards). Its 'run' variable "
                    "filters on ray_train_run_name, as Ray Train's own panels do. Exit 0.")
    p.add_argument("--out", default=None, help="write the JSON to this file (default: stdout)")
    p.set_defaults(run=run_grafana_dashboard)


def run_grafana_dashboard(args: argparse.Namespace) -> int:
    from raytrain_guard.cluster.grafana import dashboard_json
    text = dashboard_json()
    if args.out is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        with open(args.out, "w") as f:
            f.write(text)
    except OSError as exc:
        print(f"raytrain-guard grafana-dashboard: error: --out: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.out}")
    return EXIT_OK


def config_reference_markdown() -> str:
    """docs/configuration.md: every GuardConfig key with its default and the rule it comes from,
    from the dataclass metadata (``python docs/generate_configuration.py`` writes the file)."""
    import dataclasses

    lines = [_CONFIG_REFERENCE_HEADER, "| key | default | rule |", "|---|---|---|"]
    for f in dataclasses.fields(GuardConfig):
        default = "none" if f.default is None else str(f.default).lower() \
            if isinstance(f.default, bool) else f"{f.default}"
        doc = " ".join(f.metadata.get("doc", "").split()).replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


_CONFIG_REFERENCE_HEADER = """# Configuration reference

<!-- Generated from GuardConfig's field metadata (raytrain_guard/config.py); do not edit by hand.
     Regenerate with: python docs/generate_configuration.py -->

One frozen, validated `GuardConfig` holds every threshold. In Python:
`GuardConfig(headroom_frac=0.2)`; in a train loop config: `"guard": {"headroom_frac": 0.2}`; on
the command line: `raytrain-guard plan --config FILE.toml`.

A TOML file holds top-level keys or a `[raytrain_guard]` table, not both (top-level keys next to
the table are bad input: they would not be read; other tables, such as another tool's, may sit
next to it). Unknown keys, out-of-range values and unreadable files are bad input naming the
file, the key and the fix. TOML has no null: leave a key out for its default `none`.

```toml
[raytrain_guard]
headroom_frac = 0.2
host_prefetch_frac = 0.05
target_num_buckets = 8
```

Every key, its default and the rule it comes from:
"""


# -- entry point ---------------------------------------------------------------------------------

#: one entry per subcommand; each adds its parser and sets ``run``
COMMANDS: tuple[Callable[[Any], None], ...] = (
    add_plan_command,
    add_status_command,
    add_demo_command,
    add_experiment_command,
    add_grafana_dashboard_command,
)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other bad input;
    ``--help`` is unchanged. Subcommand parsers are of this class too (argparse's default)."""

    _arg_strings: Sequence[str] = ()
    #: subcommand name -> its parser (set by build_parser), to report leftovers as the command
    commands: dict[str, argparse.ArgumentParser] | None = None

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = (self.commands or {}).get(getattr(parsed, "command", None), self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def parse_known_args(self, args=None, namespace=None):
        self._arg_strings = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        hint = _dash_value_hint(message, self._arg_strings) or f"; see {self.prog} --help"
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}{hint}\n")


def _dash_value_hint(message: str, arg_strings: Sequence[str]) -> str:
    """For ``--params -7B``, which argparse reads as two options: say so, and the fix."""
    m = re.fullmatch(r"argument (\S+): expected one argument", message)
    if m is None:
        return ""
    options = m.group(1).split("/")
    for option, value in itertools.pairwise(arg_strings):
        if option in options and re.match(r"-\.?\d", value):
            return (f" (got {value!r}, which reads as an option): {option} takes a positive "
                    f"value, e.g. {option} {value[1:]}; write {option}={value} to pass a value "
                    f"that starts with '-'")
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="raytrain-guard",
        description="Keep distributed PyTorch training on Ray inside its GPU-memory, "
                    "host-memory and communication limits.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    parser.commands = dict(subparsers.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the subcommand, map errors to exit codes (2 for bad input, no traceback)."""
    args = build_parser().parse_args(argv)      # argparse errors: one line, exit 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except GuardError as err:
        print(f"raytrain-guard {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
