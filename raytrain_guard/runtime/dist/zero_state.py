"""ZeRO-1's optimizer state by parameter name: what each rank writes of a
``ZeroRedundancyOptimizer`` and reads back under another partition.

A checkpoint holds the optimizer one entry per parameter, under the name
``get_model_state_dict`` gives it (:func:`param_names`): each rank writes the state of the
parameters its local optimizer owns (:func:`zero_partition`), and a rank of any world size
reads the state of the parameters it owns now (:func:`zero_template`,
:func:`load_zero_partition`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.nn.parallel import DistributedDataParallel

from raytrain_guard.errors import InputError
from raytrain_guard.log import warn_once

logger = logging.getLogger(__name__)


def is_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (without importing torch)."""
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def param_names(module: Any) -> dict[Any, str]:
    """Parameter -> its name in ``get_model_state_dict``, the key ``get_optimizer_state_dict``
    writes its optimizer state under: the same naming, so every strategy reads the others'.
    torch's private ``_get_fqns`` gives it; without one that answers one name,
    :func:`_unwrapped_name` does (warned once)."""
    get_fqns = _torch_get_fqns()
    if get_fqns is None:
        warn_once(logger, "_get_fqns", "this torch has no torch.distributed.checkpoint."
                  "state_dict._get_fqns: checkpoint names of the optimizer state come from the "
                  "module path (DDP's 'module.' and torch.compile's '_orig_mod.' left out)")
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
    warn_once(logger, "_get_fqns", "torch.distributed.checkpoint.state_dict._get_fqns answered "
              f"{type(fqns).__name__} ({str(fqns)[:80]}), not one name: checkpoint names of "
              "the optimizer state come from the module path (DDP's 'module.' and "
              "torch.compile's '_orig_mod.' left out)")
    return None


def _torch_get_fqns() -> Any:
    """torch's private ``torch.distributed.checkpoint.state_dict._get_fqns``, or None."""
    return getattr(state_dict, "_get_fqns", None)


def _unwrapped_name(module: Any, name: str) -> str:
    """``name`` (from ``module.named_parameters()``) without the wrappers' parts that
    ``get_model_state_dict`` leaves out: a DDP wrapper's ``module``, torch.compile's
    ``_orig_mod`` and activation checkpointing's ``_checkpoint_wrapped_module``."""
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


def zero_partition(module: Any, zero: Any) -> dict[str, Any]:
    """This rank's part of a ZeroRedundancyOptimizer: the state and group settings of the
    parameters its local optimizer owns, in torch's flattened layout (one entry per parameter,
    by name)."""
    names = param_names(module)
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


def zero_template(directory: str | os.PathLike[str], module: Any,
                   zero: Any) -> tuple[dict[str, Any], list[str | None]]:
    """What this rank reads for its ZeroRedundancyOptimizer under the current partition: the
    saved state of the parameters it owns now (empty tensors shaped from the checkpoint's
    metadata, on the parameter's device; 0-dim ones such as Adam's ``step`` on CPU, as
    ZeroRedundancyOptimizer keeps them), and each parameter group's settings from its first
    parameter. Returns the template and, per group, the name whose settings it reads."""
    names = param_names(module)
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


def load_zero_partition(module: Any, zero: Any, flat: Mapping[str, Any],
                         groups: list[str | None]) -> None:
    """Load what :func:`zero_template` read into ZeRO's local optimizer (torch's own
    ``Optimizer.load_state_dict``: dtypes and devices as the parameters need them), and the
    groups' settings into ZeRO's exposed groups too (its ``step`` copies those to the local
    optimizer first)."""
    names = param_names(module)
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
