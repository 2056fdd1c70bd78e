"""Checkpoints of the shared train loop: everything a restarted run needs to continue exactly.

What the loop writes and resumes from is sharded (:func:`save_sharded`, :func:`load_sharded`):
every rank writes its own part of model and optimizer with ``torch.distributed.checkpoint``
and rank 0 a small meta file (step, loader position, every rank's RNG and gate state, losses,
batch layout, scheduler); a resume on any world size reads back the parts each rank holds now.
No rank gathers the whole model, and the meta file loads with ``weights_only=True``.

The one-file functions (:func:`gather_train_state` to rank 0, :func:`write_train_state`,
:func:`read_train_state`, :func:`load_train_state` with its broadcast from rank 0) make a
portable, unsharded copy of a run, e.g. to hand a model on; :func:`gather_objects` is the
end-of-run results' gather.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Mapping

from raytrain_guard.errors import InputError

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
FORMAT_VERSION = 1


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
    per_rank = {"rng": rng_state(), "guard": dict(guard_state or {}), "loss": loss}
    if distributed:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, per_rank)
    else:
        gathered = [per_rank]
    if rank != 0:
        return None
    return {"format_version": FORMAT_VERSION, "step": int(step), "world_size": world_size,
            "strategy": planned.strategy.value, "model": model_state, "optimizer": optim_state,
            "loader": dict(loader_state), "rng": [g["rng"] for g in gathered],
            "guard": [g["guard"] for g in gathered], "losses": [g["loss"] for g in gathered],
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
    """Read the state written by :func:`write_train_state`."""
    import torch
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise InputError("checkpoint", f"has no {STATE_FILE}", value=str(directory),
                         fix="resume only from checkpoints written by the raytrain_guard loop")
    state = torch.load(path, map_location="cpu", weights_only=False)
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
        set_rng_state(rngs[world_rank])
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
        set_rng_state(rngs[world_rank])
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
SHARDED_FORMAT_VERSION = 2


def save_sharded(directory: str | os.PathLike[str], planned: Any, optimizer: Any, *,
                 step: int, loader_state: Mapping[str, Any],
                 guard_state: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None,
                 loss: float | None = None) -> dict[str, Any]:
    """Every rank writes its own shard of model and optimizer into ``directory`` with
    ``torch.distributed.checkpoint`` (FSDP2's DTensors stay sharded; DDP's replicated tensors
    are written once); rank 0 adds :data:`META_FILE` (step, loader, every rank's RNG and gate
    state, losses, extra), gathered with one small ``all_gather_object``. A collective: every
    rank calls it, each with a directory of its own or a shared one (Ray Train merges the
    ranks' directories of one report). No rank holds more than its shard. ZeRO-1's optimizer
    is consolidated on rank 0 (ZeroRedundancyOptimizer has no sharded state dict) and written
    in the meta file. Returns the meta (every rank's view)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    zero = _is_zero(optimizer)
    state: dict[str, Any] = {"model": get_model_state_dict(planned.module)}
    zero_state = None
    if zero:
        optimizer.consolidate_state_dict(to=0)
        zero_state = optimizer.state_dict() if rank == 0 else None
    else:
        state["optimizer"] = get_optimizer_state_dict(planned.module, optimizer)
    os.makedirs(directory, exist_ok=True)
    dcp.save(state, checkpoint_id=str(directory), no_dist=not distributed)
    per_rank = {"rng": _portable(rng_state()), "guard": dict(guard_state or {}), "loss": loss}
    gathered = gather_objects(per_rank)
    meta = {"format_version": SHARDED_FORMAT_VERSION, "step": int(step),
            "world_size": world_size, "strategy": planned.strategy.value,
            "loader": dict(loader_state), "rng": [g["rng"] for g in gathered],
            "guard": [g["guard"] for g in gathered], "losses": [g["loss"] for g in gathered],
            "extra": dict(extra or {}), "zero_optimizer": zero_state}
    if rank == 0:
        tmp = os.path.join(directory, META_FILE + ".tmp")
        torch.save(meta, tmp)
        os.replace(tmp, os.path.join(directory, META_FILE))
    return meta


def load_sharded(directory: str | os.PathLike[str], planned: Any, optimizer: Any, *,
                 world_rank: int) -> dict[str, Any]:
    """Resume from :func:`save_sharded`'s ``directory`` on any world size: every rank reads the
    small meta file (``weights_only=True``: tensors, numbers and strings only) and, through
    ``torch.distributed.checkpoint``, the parts of the shards it now holds (FSDP2 is resharded
    to the new mesh). A collective. Returns the meta without the optimizer state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = read_meta(directory)
    zero = _is_zero(optimizer)
    state: dict[str, Any] = {"model": get_model_state_dict(planned.module)}
    if not zero:
        state["optimizer"] = get_optimizer_state_dict(planned.module, optimizer)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(state, checkpoint_id=str(directory), no_dist=not distributed)
    set_model_state_dict(planned.module, state["model"])
    if zero:
        optimizer.load_state_dict(meta["zero_optimizer"])
    else:
        set_optimizer_state_dict(planned.module, optimizer, state["optimizer"])
    rngs = meta.get("rng") or []
    if world_rank < len(rngs):
        set_rng_state(_native(rngs[world_rank]))
    meta.pop("zero_optimizer", None)
    logger.info("rank %d: restored step %d from shards (loader %s)", world_rank, meta["step"],
                meta.get("loader"))
    return meta


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The meta file of :func:`save_sharded` (``weights_only=True``: tensors, numbers, strings)."""
    import torch
    path = os.path.join(directory, META_FILE)
    if not os.path.exists(path):
        raise InputError("checkpoint", f"has no {META_FILE}", value=str(directory),
                         fix="resume only from checkpoints written by the raytrain_guard loop")
    meta = torch.load(path, map_location="cpu", weights_only=True)
    if meta.get("format_version") != SHARDED_FORMAT_VERSION:
        raise InputError("checkpoint", "unknown format version", value=meta.get("format_version"),
                         fix=f"write it with this version of raytrain_guard "
                             f"({SHARDED_FORMAT_VERSION})")
    return meta


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
    with ``model`` and ``optimizer`` as full state dicts. For inspection, tests and export; a
    training rank resumes with :func:`load_sharded`."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = read_meta(directory)
    with tempfile.TemporaryDirectory(prefix="rtg-read-") as tmp:
        whole = os.path.join(tmp, "whole.pt")
        dcp_to_torch_save(directory, whole)
        meta.update(torch.load(whole, map_location="cpu", weights_only=True))
    return meta
