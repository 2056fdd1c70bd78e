"""Which modules of a model become FSDP2 units: what the planner sizes (the largest unit's
parameters, :mod:`raytrain_guard.planner.trace`) and what the planned wrapping shards
(:mod:`raytrain_guard.runtime.dist.model`)."""

from __future__ import annotations

from typing import Any


def wrap_units(model: Any) -> list[Any]:
    """The modules that become FSDP2 units: what
    :func:`raytrain_guard.runtime.dist.model._wrap_fsdp2` shards and what the planner sizes
    (``trace.model_stats_of`` -> ``ModelStats.largest_unit_params``).

    A transformer-like model (a direct ``ModuleList``/``Sequential`` child with several
    elements, the model itself not a ``Sequential``): each element (block) is a unit. Otherwise
    each direct child with parameters is a unit; a ``Sequential`` child with several elements
    is split into its elements. Containers without ``forward`` (``ModuleList``, ``ModuleDict``)
    are never units themselves (``fully_shard`` rejects them): their elements are. The root
    holds the rest (e.g. tied embeddings and head, which must stay in one unit).
    """
    import torch  # import-light module: torch only when a model is walked

    no_forward = (torch.nn.ModuleList, torch.nn.ModuleDict)

    def is_list(module: Any) -> bool:
        return isinstance(module, no_forward) or (
            isinstance(module, torch.nn.Sequential) and len(module) > 1)

    lists = [c for c in model.children()
             if isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential)) and len(c) > 1]
    if lists and not isinstance(model, torch.nn.Sequential):
        candidates = [m for c in lists for m in c.children()]
    else:
        candidates = []
        for child in model.children():
            candidates.extend(child.children() if is_list(child) else [child])
    units = []
    for module in candidates:  # a nested container (ModuleList in a ModuleList): its elements
        units.extend(module.children() if isinstance(module, no_forward) else [module])
    return [m for m in units if any(True for _ in m.parameters())]
