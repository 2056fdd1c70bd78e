"""A sharded checkpoint read whole in this process, to look inside what the loop wrote."""

from __future__ import annotations

import os
from typing import Any

from raytrain_guard.runtime.dist.checkpoint import SafeLoadPlanner, read_meta


def read_sharded(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A sharded checkpoint whole, in this process (no process group, no model): the meta
    with ``model`` (a full state dict) and ``optimizer`` (one entry per parameter:
    ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<key>``, what
    ``set_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``
    loads), whichever strategy wrote it. Every entry is read with ``weights_only=True``."""
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
    dcp.load(whole, checkpoint_id=str(directory), planner=SafeLoadPlanner(), no_dist=True)
    meta.update(whole)
    return meta
