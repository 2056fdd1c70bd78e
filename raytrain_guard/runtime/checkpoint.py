"""Checkpoints of the shared train loop: everything a restarted run needs to continue exactly.

What the loop writes and resumes from is sharded (:func:`save_sharded`, :func:`load_sharded`):
every rank writes its own part of model and optimizer with ``torch.distributed.checkpoint``
and rank 0 a small meta file (step, loader position, every rank's RNG and gate state, losses,
batch layout, scheduler); a resume on any world size reads back the parts each rank holds now.
The optimizer is written one entry per parameter, by name, under every strategy (ZeRO-1: each
rank its own partition), so a resume may change the world size and the strategy. No rank
gathers the whole model or optimizer, and every part of a sharded checkpoint loads with
``weights_only=True``.

The one-file functions (:func:`gather_train_state` to rank 0, :func:`write_train_state`,
:func:`read_train_state`, :func:`load_train_state` with its broadcast from rank 0) make a
portable, unsharded copy of a run, e.g. to hand a model on (it loads with ``weights_only=True``
too); the loop does not use them. :func:`gather_objects` is the end-of-run results' gather.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from typing import Any

from raytrain_guard.errors import InputError

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


STATE_FILE = "train_state.pt"
FORMAT_VERSION = 2            # 2: RNG states stored loadable with weights_only=True


def rng_state() -> dict[str, Any]:
    """This process's random number generator states."""
    import torch
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import torch
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy
            numpy.random.set_state(state["numpy"])
        except ImportError:  # pragma: no cover
            pass


def gather_train_state(planned: Any, optimizer: Any, *, step: int,
                       loader_state: Mapping[str, Any], guard_state: Mapping[str, Any] | None,
                       extra: Mapping[str, Any] | None = None,
                       loss: float | None = None) -> dict[str, Any] | None:
    """Collect the run's state on rank 0 (a collective: every rank must call it).

    Returns the state on rank 0 (with every rank's ``loss`` in ``losses``, gathered with the
    RNG states: no collective of its own) and ``None`` on the other ranks.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(planned.module, options=options)
    if _is_zero(optimizer):
        optimizer.consolidate_state_dict(to=0)
        optim_state = optimizer.state_dict() if rank == 0 else None
    else:
        optim_state = get_optimizer_state_dict(planned.module, optimizer, options=options)
    ranks = _rank_states(guard_state, loss)
    if rank != 0:
        return None
    return {"format_version": FORMAT_VERSION, "step": int(step), "world_size": world_size,
            "strategy": planned.strategy.value, "model": model_state, "optimizer": optim_state,
            "loader": dict(loader_state), **ranks,
            "extra": dict(extra or {})}


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``all_gather_object`` on the default group: a
    collective, every rank calls it); ``[obj]`` outside torch.distributed. The train loop's
    end-of-run results go through it, next to the checkpoint they are written with."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank_states(guard_state: Mapping[str, Any] | None, loss: float | None
                 ) -> dict[str, list[Any]]:
    """Every rank's RNG states (loadable with ``weights_only=True``), gate state and loss, in
    rank order: one ``all_gather_object`` (a collective: every rank calls it)."""
    gathered = gather_objects({"rng": _portable(rng_state()), "guard": dict(guard_state or {}),
                               "loss": loss})
    return {"rng": [g["rng"] for g in gathered], "guard": [g["guard"] for g in gathered],
            "losses": [g["loss"] for g in gathered]}


def write_train_state(directory: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
    """Write ``state`` into ``directory`` (created if needed); returns the file path."""
    import torch
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, STATE_FILE)
    tmp = path + ".tmp"
    torch.save(dict(state), tmp)
    os.replace(tmp, path)
    return path


def read_train_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the state written by :func:`write_train_state` (``weights_only=True``: tensors,
    numbers, strings and their containers; nothing in the file runs code)."""
    import pickle

    import torch
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise InputError("checkpoint", f"has no {STATE_FILE}", value=str(directory),
                         fix="resume only from checkpoints written by the raytrain_guard loop")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise InputError("checkpoint", f"{STATE_FILE} holds objects a safe load refuses "
                         f"({str(exc).splitlines()[0][:120]})", value=str(directory),
                         fix=f"write it with this version of raytrain_guard "
                             f"({FORMAT_VERSION})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise InputError("checkpoint", "unknown format version",
                         value=state.get("format_version"),
                         fix=f"write it with this version of raytrain_guard ({FORMAT_VERSION})")
    return state


def restore_train_state(planned: Any, optimizer: Any, state: Mapping[str, Any], *,
                        world_rank: int) -> None:
    """Load model, optimizer and this rank's RNG states (every rank calls it).

    The world size may differ from the one that wrote the checkpoint: model and optimizer are
    full state dicts; RNG states exist only for ranks that existed, other ranks keep theirs.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(planned.module, state["model"], options=options)
    if _is_zero(optimizer):
        optimizer.load_state_dict(state["optimizer"])
    else:
        set_optimizer_state_dict(planned.module, optimizer, state["optimizer"], options=options)
    rngs = state.get("rng") or []
    if world_rank < len(rngs):
        set_rng_state(_native(rngs[world_rank]))
    logger.info("rank %d: restored step %d (loader %s)", world_rank, state["step"],
                state.get("loader"))


def load_train_state(directory: str | os.PathLike[str] | None, planned: Any, optimizer: Any, *,
                     world_rank: int) -> dict[str, Any]:
    """Resume from ``directory``: rank 0 reads the file; model and optimizer come to the other
    ranks by broadcast (``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``;
    ZeRO-1's consolidated optimizer state as one object), the small rest (step, loader,
    guard, RNG, extra) as one object. A collective: every rank calls it (``directory`` is read
    on rank 0 only). Returns the state without ``model`` and ``optimizer`` on every rank. A
    file rank 0 cannot read raises the same InputError on every rank (no rank is left waiting).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        state = read_train_state(_must_be(directory))
        restore_train_state(planned, optimizer, state, world_rank=world_rank)
        return {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    zero = _is_zero(optimizer)
    full: dict[str, Any] = {}
    head: dict[str, Any] = {}
    if dist.get_rank() == 0:
        try:
            full = read_train_state(_must_be(directory))
            head = {k: v for k, v in full.items() if k not in ("model", "optimizer")}
            if zero:
                head["optimizer"] = full["optimizer"]
        except InputError as exc:
            head = {"error": exc}
    box = [head]
    dist.broadcast_object_list(box, src=0)
    head = box[0]
    if "error" in head:
        raise head["error"]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(planned.module, full.get("model", {}), options=options)
    if zero:
        optimizer.load_state_dict(head.pop("optimizer"))
    else:
        set_optimizer_state_dict(planned.module, optimizer, full.get("optimizer", {}),
                                 options=options)
    rngs = head.get("rng") or []
    if world_rank < len(rngs):
        set_rng_state(_native(rngs[world_rank]))
    logger.info("rank %d: restored step %d (loader %s; %s)", world_rank, head["step"],
                head.get("loader"), "read here" if dist.get_rank() == 0 else "from rank 0")
    return head


def _must_be(directory: str | os.PathLike[str] | None) -> str | os.PathLike[str]:
    if directory is None:
        raise InputError("checkpoint", "no directory on rank 0", value=None,
                         fix="resume only where rank 0 sees the checkpoint")
    return directory


def _is_zero(optimizer: Any) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


# -- sharded checkpoints (torch.distributed.checkpoint) ----------------------------------------

META_FILE = "train_meta.pt"
SHARDED_FORMAT_VERSION = 3
#: The optimizer in the shards: one entry per parameter, keyed by its fully qualified name
#: (torch's flattened optimizer state dict: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``),
#: under every strategy, so any strategy and world size can read any other's.
OPTIMIZER_LAYOUT = "per-parameter"


def save_sharded(directory: str | os.PathLike[str], planned: Any, optimizer: Any, *,
                 step: int, loader_state: Mapping[str, Any],
                 guard_state: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None,
                 loss: float | None = None) -> dict[str, Any]:
    """Every rank writes its own shard of model and optimizer into ``directory`` with
    ``torch.distributed.checkpoint`` (FSDP2's DTensors stay sharded; DDP's replicated tensors
    are written once, spread over the ranks; ZeRO-1's optimizer state by the rank that owns
    each parameter); rank 0 adds :data:`META_FILE` (step, loader, every rank's RNG and gate
    state, losses, extra), gathered with one small ``all_gather_object``. A collective: every
    rank calls it, each with a directory of its own or a shared one (Ray Train merges the
    ranks' directories of one report). No rank holds more than its shard. The optimizer is
    written per parameter (:data:`OPTIMIZER_LAYOUT`). A meta that would not load with
    ``weights_only=True`` raises an InputError naming its entry on every rank, before anything
    is written. Returns the meta (every rank's view)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    state: dict[str, Any] = {"model": get_model_state_dict(planned.module)}
    if _is_zero(optimizer):
        state["optimizer"] = _zero_partition(planned.module, optimizer)
    else:
        state["optimizer"] = get_optimizer_state_dict(
            planned.module, optimizer,
            options=StateDictOptions(flatten_optimizer_state_dict=True))
    meta = {"format_version": SHARDED_FORMAT_VERSION, "step": int(step),
            "world_size": world_size, "strategy": planned.strategy.value,
            "optimizer_layout": OPTIMIZER_LAYOUT, "loader": dict(loader_state),
            **_rank_states(guard_state, loss),
            "extra": dict(extra or {})}
    meta_bytes = _safe_meta_bytes(meta)     # every rank: a meta that would not load fails all
    os.makedirs(directory, exist_ok=True)
    dcp.save(state, checkpoint_id=str(directory), no_dist=not distributed)
    if rank == 0:
        tmp = os.path.join(directory, META_FILE + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(meta_bytes)
        os.replace(tmp, os.path.join(directory, META_FILE))
    return meta


def _safe_meta_bytes(meta: Mapping[str, Any]) -> bytes:
    """``meta`` serialized with ``torch.save``, after checking that it loads back with
    ``weights_only=True`` (what :func:`read_meta` does at resume): a meta holding anything but
    tensors, numbers, strings and their containers raises an InputError naming the entry now,
    at save time, instead of a checkpoint that no resume can read."""
    import io

    import torch

    def serialized(value: Any) -> tuple[bytes, str | None]:
        """``value`` saved, and why it cannot be saved or loaded back (None: it can)."""
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal is the same user error
            return b"", _load_error(exc)
        return buffer.getvalue(), None

    data, problem = serialized(dict(meta))
    if problem is None:
        return data
    entry, value = "meta", dict(meta)
    while isinstance(value, Mapping):       # down to the entry that is refused by itself
        child = next(((k, v) for k, v in value.items() if serialized(v)[1] is not None), None)
        if child is None:
            break
        entry = str(child[0]) if entry == "meta" else f"{entry}.{child[0]}"
        value = child[1]
    raise InputError(entry, f"would make {META_FILE} unreadable at resume: it does not save "
                     f"and load back with weights_only=True ({problem})",
                     value=type(value).__name__,
                     fix="keep loader state, guard state and extra to tensors, numbers, "
                         "strings and lists, tuples or dicts of them")


def _load_error(exc: BaseException) -> str:
    """The line of a failed ``torch.load`` that says why (torch's message runs to many lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = next((line for line in lines if "Unpickler error" in line),
                  lines[0] if lines else type(exc).__name__)
    return reason[:160]


def load_sharded(directory: str | os.PathLike[str], planned: Any, optimizer: Any, *,
                 world_rank: int) -> dict[str, Any]:
    """Resume from :func:`save_sharded`'s ``directory`` on any world size and strategy: every
    rank reads the small meta file (``weights_only=True``: tensors, numbers and strings only)
    and, through ``torch.distributed.checkpoint``, the parts of the shards it now holds (FSDP2
    is resharded to the new mesh; ZeRO-1 reads the state of the parameters it owns under the
    new partition). Non-tensor entries load with ``weights_only=True`` too. A collective.
    Returns the meta."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = read_meta(directory)
    zero = _is_zero(optimizer)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict[str, Any] = {"model": get_model_state_dict(planned.module)}
    if zero:
        state["optimizer"], groups = _zero_template(directory, planned.module, optimizer)
    else:
        state["optimizer"] = get_optimizer_state_dict(planned.module, optimizer, options=flat)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(state, checkpoint_id=str(directory), planner=_safe_load_planner(),
             no_dist=not distributed)
    set_model_state_dict(planned.module, state["model"])
    if zero:
        _load_zero_partition(planned.module, optimizer, state["optimizer"], groups)
    else:
        set_optimizer_state_dict(planned.module, optimizer, state["optimizer"], options=flat)
    rngs = meta.get("rng") or []
    if world_rank < len(rngs):
        set_rng_state(_native(rngs[world_rank]))
    logger.info("rank %d: restored step %d from shards (loader %s)", world_rank, meta["step"],
                meta.get("loader"))
    return meta


def is_complete(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a whole :func:`save_sharded` checkpoint: its meta file, and
    every shard file its ``torch.distributed.checkpoint`` metadata names, at least as long as
    the entries it holds there. A copy cut short (a torn checkpoint) lacks one of them."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(directory, META_FILE)):
        return False
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
        ends: dict[str, int] = {}
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                           info.offset + info.length)
    except Exception:  # noqa: BLE001 - no metadata, or one that does not read: not whole
        return False
    return all(os.path.isfile(path := os.path.join(directory, name))
               and os.path.getsize(path) >= end for name, end in ends.items())


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The meta file of :func:`save_sharded` (``weights_only=True``: tensors, numbers, strings)."""
    import torch
    path = os.path.join(directory, META_FILE)
    if not os.path.exists(path):
        raise InputError("checkpoint", f"has no {META_FILE}", value=str(directory),
                         fix="resume only from checkpoints written by the raytrain_guard loop")
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torn, truncated or unsafe: the same user error
        raise InputError("checkpoint", f"{META_FILE} cannot be read with weights_only=True "
                         f"({_load_error(exc)})", value=path,
                         fix="resume from another checkpoint (this file is torn or was not "
                             "written by raytrain_guard's save_sharded)") from None
    if not isinstance(meta, Mapping):
        raise InputError("checkpoint", f"{META_FILE} holds no meta dict", value=path,
                         fix="resume only from checkpoints written by the raytrain_guard loop")
    if meta.get("format_version") != SHARDED_FORMAT_VERSION:
        raise InputError("checkpoint", "unknown format version", value=meta.get("format_version"),
                         fix=f"write it with this version of raytrain_guard "
                             f"({SHARDED_FORMAT_VERSION})")
    if meta.get("optimizer_layout") != OPTIMIZER_LAYOUT or "zero_optimizer" in meta:
        raise InputError("checkpoint", f"optimizer state not stored {OPTIMIZER_LAYOUT} (a "
                         f"consolidated optimizer in the meta file is not read)",
                         value=meta.get("optimizer_layout"),
                         fix="resume from a checkpoint written by this version of "
                             "raytrain_guard's save_sharded")
    return meta


def _safe_load_planner() -> Any:
    """A load planner whose non-tensor entries (optimizer hyper-parameters, ...) are
    deserialized with ``weights_only=True`` (DCP's default planner loads them unrestricted)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            torch.load(value, weights_only=True)     # raises on anything but plain data
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeLoadPlanner()


def _param_names(module: Any) -> dict[Any, str]:
    """Parameter -> its name in ``get_model_state_dict`` (DDP's ``module.``, torch.compile's and
    activation checkpointing's prefixes left out), the key its optimizer state is written under
    by ``get_optimizer_state_dict``: the same naming, so every strategy reads the others'.

    torch names them with its private ``_get_fqns``; where this torch has none, or it answers
    with anything but one name, :func:`_unwrapped_name` gives the name (warned once): the same
    names for a plain, DDP-wrapped or compiled module."""
    get_fqns = _torch_get_fqns()
    if get_fqns is None:
        _warn_once("_get_fqns", "this torch has no torch.distributed.checkpoint.state_dict."
                   "_get_fqns: checkpoint names of the optimizer state come from the module "
                   "path (DDP's 'module.' and torch.compile's '_orig_mod.' left out)")
    names: dict[Any, str] = {}
    for name, param in module.named_parameters():
        if param not in names:
            names[param] = _torch_name(get_fqns, module, name) or _unwrapped_name(module, name)
    return names


def _torch_name(get_fqns: Any, module: Any, name: str) -> str | None:
    """The one name ``get_fqns(module, name)`` answers; None without ``get_fqns``, or (warned
    once) when it raises or answers anything but one name: a changed private API."""
    if get_fqns is None:
        return None
    try:
        fqns = get_fqns(module, name)
    except Exception as exc:  # noqa: BLE001 - a changed private API: fall back
        fqns = exc
    if isinstance(fqns, (set, frozenset, list, tuple)) and len(fqns) == 1:
        fqn = next(iter(fqns))
        if isinstance(fqn, str) and fqn:
            return fqn
    _warn_once("_get_fqns", f"torch.distributed.checkpoint.state_dict._get_fqns answered "
               f"{type(fqns).__name__} ({str(fqns)[:80]}), not one name: checkpoint names of "
               f"the optimizer state come from the module path (DDP's 'module.' and "
               f"torch.compile's '_orig_mod.' left out)")
    return None


def _torch_get_fqns() -> Any:
    """torch's private ``torch.distributed.checkpoint.state_dict._get_fqns``, or None."""
    from torch.distributed.checkpoint import state_dict
    return getattr(state_dict, "_get_fqns", None)


def _unwrapped_name(module: Any, name: str) -> str:
    """``name`` (from ``module.named_parameters()``) without the wrappers' parts that
    ``get_model_state_dict`` leaves out: a DDP wrapper's ``module``, torch.compile's
    ``_orig_mod`` and activation checkpointing's ``_checkpoint_wrapped_module``."""
    from torch.nn.parallel import DistributedDataParallel

    kept = []
    node = module
    for part in name.split("."):
        wrapper = (part == "module" and isinstance(node, DistributedDataParallel)) or \
            (part == "_orig_mod" and type(node).__name__ == "OptimizedModule") or \
            part == "_checkpoint_wrapped_module"
        if not wrapper:
            kept.append(part)
        node = getattr(node, part, None)
    return ".".join(kept)


def _zero_partition(module: Any, zero: Any) -> dict[str, Any]:
    """This rank's part of a ZeroRedundancyOptimizer: the state and group settings of the
    parameters its local optimizer owns, in torch's flattened layout (one entry per parameter,
    by name), so that each rank writes only its partition and a reader of any world size finds
    each parameter's state by name."""
    names = _param_names(module)
    local = zero.optim
    out: dict[str, Any] = {}
    # settings from ZeRO's exposed groups: a scheduler writes there, and ZeRO copies them to
    # the local optimizer only at its next step
    for exposed, group in zip(zero.param_groups, local.param_groups):
        settings = {k: v for k, v in exposed.items() if k != "params"}
        for param in group["params"]:
            fqn = names[param]
            for key, value in _flatten(local.state.get(param, {}), f"state.{fqn}"):
                out[key] = value
            for key, value in settings.items():
                out[f"param_groups.{fqn}.{key}"] = value
    return out


def _flatten(nested: Mapping[Any, Any], prefix: str):
    for key, value in nested.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}.{key}")
        else:
            yield f"{prefix}.{key}", value


def _zero_template(directory: str | os.PathLike[str], module: Any,
                   zero: Any) -> tuple[dict[str, Any], list[str | None]]:
    """What this rank reads for its ZeroRedundancyOptimizer under the current partition: the
    saved state of the parameters it owns now (empty tensors shaped from the checkpoint's
    metadata, on the parameter's device; 0-dim ones such as Adam's ``step`` on CPU, as
    ZeroRedundancyOptimizer keeps them), and each parameter group's settings from its first
    parameter. Returns the template and, per group, the name whose settings it reads."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    names = _param_names(module)
    owned = {names[p]: p for group in zero.optim.param_groups for p in group["params"]}
    groups = [names[g["params"][0]] if g["params"] else None for g in zero.param_groups]
    heads = set(filter(None, groups))
    template: dict[str, Any] = {}
    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for key, item in metadata.items():
        if not key.startswith("optimizer."):
            continue
        section, _, rest = key[len("optimizer."):].partition(".")
        fqn = _owner(rest, owned if section == "state" else heads)
        if fqn is None:
            continue
        if isinstance(item, TensorStorageMetadata):
            device = owned[fqn].device if section == "state" and len(item.size) else "cpu"
            value: Any = torch.empty(item.size, dtype=item.properties.dtype, device=device)
        else:
            value = None                    # a plain value, read as it was written
        template[key[len("optimizer."):]] = value
    missing = [fqn for fqn in heads if not any(k.startswith(f"param_groups.{fqn}.")
                                               for k in template)]
    if missing:
        raise InputError("checkpoint", "has no optimizer settings for parameter(s) "
                         + ", ".join(sorted(missing)), value=str(directory),
                         fix="resume with the model and parameter groups the checkpoint was "
                             "written with")
    return template, groups


def _owner(rest: str, fqns: Any) -> str | None:
    """The name in ``fqns`` that ``rest`` (``<fqn>.<entry>``) starts with, or None; names
    contain dots, so every split point is tried."""
    parts = rest.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        if name in fqns:
            return name
    return None


def _load_zero_partition(module: Any, zero: Any, flat: Mapping[str, Any],
                         groups: list[str | None]) -> None:
    """Load what :func:`_zero_template` read into ZeRO's local optimizer (torch's own
    ``Optimizer.load_state_dict``: dtypes and devices as the parameters need them), and the
    groups' settings into ZeRO's exposed groups too (its ``step`` copies those to the local
    optimizer first)."""
    names = _param_names(module)
    local = zero.optim
    state: dict[int, Any] = {}
    param_groups: list[dict[str, Any]] = []
    index = 0
    for group, head in zip(local.param_groups, groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        if head is not None:
            prefix = f"param_groups.{head}."
            settings.update({k[len(prefix):]: v for k, v in flat.items()
                             if k.startswith(prefix)})
        ids = []
        for param in group["params"]:
            entries = _nest(flat, f"state.{names[param]}.")
            if entries:
                state[index] = entries
            ids.append(index)
            index += 1
        param_groups.append(dict(settings, params=ids))
    local.load_state_dict({"state": state, "param_groups": param_groups})
    for exposed, group in zip(zero.param_groups, local.param_groups):
        exposed.update((k, v) for k, v in group.items() if k != "params")


def _nest(flat: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(prefix):
            *path, last = key[len(prefix):].split(".")
            node = out
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    return out


def _portable(state: Mapping[str, Any]) -> dict[str, Any]:
    """RNG states with NumPy's array as a list: loadable with ``weights_only=True``."""
    out = dict(state)
    if "numpy" in out:
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, [int(k) for k in keys], pos, has_gauss, cached)
    return out


def _native(state: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(state)
    if "numpy" in out:
        import numpy
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached)
    return out


def read_sharded(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A sharded checkpoint whole, in this process (no process group, no model): the meta
    with ``model`` (a full state dict) and ``optimizer`` (one entry per parameter:
    ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<key>``, what
    ``set_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``
    loads), whichever strategy wrote it. Every entry is read with ``weights_only=True``. For
    inspection, tests and export; a training rank resumes with :func:`load_sharded`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_meta(directory)
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    # every entry the checkpoint holds, shaped from its metadata (as dcp_to_torch_save does),
    # then read into place: tensors whole, plain values with weights_only=True
    whole: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        *path, last = metadata.planner_data.get(key, (key,))
        node = whole
        for part in path:
            node = node.setdefault(part, {})
        node[last] = torch.empty(item.size, dtype=item.properties.dtype) \
            if isinstance(item, TensorStorageMetadata) else None
    dcp.load(whole, checkpoint_id=str(directory), planner=_safe_load_planner(), no_dist=True)
    meta.update(whole)
    return meta
