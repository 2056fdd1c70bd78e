"""Where ``raytrain-guard plan`` takes its inputs from: the model (a parameter count, a traced
factory or the transformer shape), the data (a size or a measured batch), the config and the
machine (this one's by default). Torch, NVML and psutil are imported only where a flag needs
them: a plan from sizes alone starts in a fraction of a second.
"""

from __future__ import annotations

import json
from typing import Any

from raytrain_guard.cli.args import (
    MAX_PARAMS,
    call_user,
    import_path,
    positive_int,
    size,
)
from raytrain_guard.config import GuardConfig
from raytrain_guard.errors import InputError, PlanInputError
from raytrain_guard.factories import load_object
from raytrain_guard.planner.activations import analytic_transformer
from raytrain_guard.planner.memory_model import default_fsdp_unit_params
from raytrain_guard.planner.model_stats import ActivationProfile, ModelStats
from raytrain_guard.runtime.host_memory import host_memory
from raytrain_guard.units import format_bytes, parse_count

#: the transformer shape's flags, as argparse names them
SHAPE = ("layers", "hidden", "heads", "seq_len", "vocab")


def model_source(args, setup) -> tuple[Any, Any, tuple[str, ...]]:
    """(ModelStats, ActivationProfile, notes) from exactly one of the three model sources."""
    shape_flags = [getattr(args, name) for name in SHAPE]
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
    unit_flag = args.fsdp_unit_params
    if unit_flag is not None and args.params is None:
        raise PlanInputError("--fsdp-unit-params", "only applies with --params", value=unit_flag,
                             fix="drop it: the shape and the trace know the model's FSDP units")
    if args.params is not None:
        n = parse_count(args.params, field="--params", at_most=MAX_PARAMS)
        model = ModelStats(num_params=n, num_trainable_params=n,
                           largest_unit_params=_unit_params(unit_flag, n))
        if args.activation_bytes_per_sample is None:
            return model, ActivationProfile(0.0, source="unknown"), ()
        per_sample = size(args.activation_bytes_per_sample, "--activation-bytes-per-sample")
        return model, ActivationProfile(float(per_sample), source="given"), ()
    if args.model is not None:
        if args.sample is None:
            raise PlanInputError("--sample", "is required with --model", fix="pass --sample "
                                 "MODULE:FACTORY returning one batch")
        from raytrain_guard.planner.trace import trace_model

        import_path()
        traced = trace_model(args.model, args.sample, loss=args.loss,
                             precision=setup.precision, optimizer=setup.optimizer)
        notes = ((f"traced {args.model} in {traced.trace_s:.1f} s ({traced.mode} device), "
                 f"loss: {traced.loss}"),) + traced.warnings
        return traced.model_stats, traced.activations, notes
    missing = [f"--{n.replace('_', '-')}" for n, v in zip(SHAPE, shape_flags) if v is None]
    if missing:
        raise PlanInputError(missing[0], "is required with the other shape flags",
                             fix="give all of --layers --hidden --heads --seq-len --vocab")
    options = {"gated_mlp": args.gated_mlp, "tied_embeddings": args.tied_embeddings,
               "dropout": args.dropout, "bias": not args.no_bias,
               "expand_kv": not args.no_expand_kv}
    if args.norm is not None:
        options["norm"] = args.norm
    if args.ffn_hidden is not None:
        options["ffn_hidden"] = positive_int(args.ffn_hidden, "--ffn-hidden")
    if args.kv_heads is not None:
        options["num_kv_heads"] = positive_int(args.kv_heads, "--kv-heads")
    dims = {n: positive_int(v, f"--{n.replace('_', '-')}") for n, v in zip(SHAPE, shape_flags)}
    model, acts = analytic_transformer(**dims, precision=setup.precision,
                                       recompute=args.recompute or "none",
                                       attention=args.attention or "flash", **options)
    return model, acts, acts.notes


def _unit_params(text, num_params: int) -> int:
    """``--fsdp-unit-params``, or the core's default share of ``num_params``."""
    if text is None:
        return default_fsdp_unit_params(num_params)
    unit = parse_count(text, field="--fsdp-unit-params", at_most=MAX_PARAMS)
    if not 0 < unit <= num_params:
        raise PlanInputError("--fsdp-unit-params", f"must be between 1 and --params "
                             f"({num_params})", value=text,
                             fix="give the parameters of the largest FSDP unit (one block, or "
                                 "the embedding and head)")
    return unit


def data_source(args, config) -> tuple[int | None, float | None, bool, tuple[str, ...]]:
    """(batch_bytes, sample_bytes, list_backed, notes) from --batch-bytes, --dataset, --sample.
    Only a measured batch imports torch (batch_inspect)."""
    if args.batch_bytes is not None:
        return size(args.batch_bytes, "--batch-bytes"), None, False, ()
    if args.dataset is None and args.sample is None:
        return None, None, False, ()
    from raytrain_guard.planner import batch_inspect

    import_path()
    if args.dataset is not None:
        factory = load_object(args.dataset, field_name="--dataset", error=PlanInputError)
        dataset = call_user(factory, "--dataset")
        measured = batch_inspect.measure_dataset(dataset, config=config)
        found = batch_inspect.list_backed_attributes(
            dataset, min_items=config.list_dataset_min_items)
        note = (f"batch bytes from {measured.batch_size} samples of --dataset: "
                f"{format_bytes(measured.bytes_per_sample)} per sample")
        if found:
            note += f"; Python containers in the dataset: {', '.join(found)}"
        return None, measured.bytes_per_sample, bool(found), (note,)
    factory = load_object(args.sample, field_name="--sample", error=PlanInputError)
    measured = batch_inspect.measure_batch(call_user(factory, "--sample"))
    note = (f"batch bytes from --sample: {format_bytes(measured.batch_bytes)} for "
            f"{measured.batch_size or 1} samples")
    return None, measured.bytes_per_sample, False, (note,)


def plan_config(args) -> GuardConfig:
    config = GuardConfig.from_toml(args.config) if args.config else GuardConfig()
    for flag, value, field_name, example in (
            ("--headroom", args.headroom, "headroom_frac", "0.15 or 15%"),
            ("--fragmentation", args.fragmentation, "fragmentation_frac", "0.14 or 14%")):
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


def curve(args) -> list[tuple[int, float]] | None:
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


# -- machine defaults (torch and NVML imported here only: the CLI starts without them) -----------

def gpu_memory(args) -> int:
    """``--gpu-mem``, else the memory of this machine's first CUDA device (torch imported)."""
    if args.gpu_mem is not None:
        return size(args.gpu_mem, "--gpu-mem")
    import torch

    if not torch.cuda.is_available():
        raise PlanInputError("--gpu-mem", "is required: no CUDA device on this machine",
                             fix="pass the memory of one GPU, e.g. --gpu-mem 80GiB")
    return int(torch.cuda.get_device_properties(0).total_memory)


def local_gpus() -> int:
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


def machine_memory() -> int:
    """This machine's RAM as the run may use it (the container's cgroup limit when lower)."""
    return host_memory()[0]
