"""Checkpoints of the shared train loop: everything a restarted run needs to continue exactly,
written as shards (:func:`save_sharded`) and read back on any world size and strategy
(:func:`load_sharded`). No rank gathers the whole model or optimizer, and every entry loads
with ``weights_only=True``.
"""

from __future__ import annotations

import io
import logging
import os
import random
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from raytrain_guard.errors import InputError
from raytrain_guard.runtime.dist.zero_state import (
    is_zero,
    load_zero_partition,
    zero_partition,
    zero_template,
)

logger = logging.getLogger(__name__)

META_FILE = "train_meta.pt"
SHARDED_FORMAT_VERSION = 3
#: The optimizer in the shards: one entry per parameter, keyed by its fully qualified name
#: (torch's flattened optimizer state dict: ``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``),
#: under every strategy, so any strategy and world size can read any other's.
OPTIMIZER_LAYOUT = "per-parameter"


def rng_state() -> dict[str, Any]:
    """This process's random number generator states, loadable with ``weights_only=True``
    (NumPy's key array as a list)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (name, [int(k) for k in keys], pos, has_gauss, cached)
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy
            name, keys, pos, has_gauss, cached = state["numpy"]
            numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos,
                                    has_gauss, cached))
        except ImportError:  # pragma: no cover
            pass


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``all_gather_object`` on the default group: a
    collective, every rank calls it); ``[obj]`` outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank_states(guard_state: Mapping[str, Any] | None, loss: float | None
                 ) -> dict[str, list[Any]]:
    """Every rank's RNG states (loadable with ``weights_only=True``), gate state and loss, in
    rank order (a collective)."""
    gathered = gather_objects({"rng": rng_state(), "guard": dict(guard_state or {}),
                               "loss": loss})
    return {"rng": [g["rng"] for g in gathered], "guard": [g["guard"] for g in gathered],
            "losses": [g["loss"] for g in gathered]}


def save_sharded(directory: str | os.PathLike[str], planned: Any, optimizer: Any, *,
                 step: int, loader_state: Mapping[str, Any],
                 guard_state: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None,
                 loss: float | None = None) -> dict[str, Any]:
    """Every rank writes its own shard of model and optimizer into ``directory`` with
    ``torch.distributed.checkpoint`` (FSDP2's DTensors stay sharded; DDP's replicated tensors
    are written once, spread over the ranks; ZeRO-1's optimizer state by the rank that owns
    each parameter), the optimizer per parameter (:data:`OPTIMIZER_LAYOUT`); rank 0 adds
    :data:`META_FILE` (step, loader, every rank's RNG and gate state, losses, extra). A
    collective: every rank calls it, each with a directory of its own or a shared one. A meta
    that would not load with ``weights_only=True`` raises an InputError naming its entry on
    every rank, before anything is written. Returns the meta."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    state: dict[str, Any] = {"model": get_model_state_dict(planned.module)}
    if is_zero(optimizer):
        state["optimizer"] = zero_partition(planned.module, optimizer)
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
    meta = read_meta(directory)
    zero = is_zero(optimizer)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict[str, Any] = {"model": get_model_state_dict(planned.module)}
    if zero:
        state["optimizer"], groups = zero_template(directory, planned.module, optimizer)
    else:
        state["optimizer"] = get_optimizer_state_dict(planned.module, optimizer, options=flat)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(state, checkpoint_id=str(directory), planner=SafeLoadPlanner(),
             no_dist=not distributed)
    set_model_state_dict(planned.module, state["model"])
    if zero:
        load_zero_partition(planned.module, optimizer, state["optimizer"], groups)
    else:
        set_optimizer_state_dict(planned.module, optimizer, state["optimizer"], options=flat)
    rngs = meta.get("rng") or []
    if world_rank < len(rngs):
        set_rng_state(rngs[world_rank])
    logger.info("rank %d: restored step %d from shards (loader %s)", world_rank, meta["step"],
                meta.get("loader"))
    return meta


def is_complete(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a whole :func:`save_sharded` checkpoint: its meta file, and
    every shard file its ``torch.distributed.checkpoint`` metadata names, at least as long as
    the entries it holds there. A copy cut short (a torn checkpoint) lacks one of them."""
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


class SafeLoadPlanner(DefaultLoadPlanner):
    """A load planner whose non-tensor entries (optimizer hyper-parameters, ...) are
    deserialized with ``weights_only=True`` (DCP's default planner loads them unrestricted)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        torch.load(value, weights_only=True)     # raises on anything but plain data
        value.seek(0)
        super().load_bytes(read_item, value)
