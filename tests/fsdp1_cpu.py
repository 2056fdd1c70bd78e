"""Lightning's ``RayFSDPStrategy`` (torch's FSDP1) on this CPU-only machine.

FSDP1 picks its device from the accelerator when ``device_id`` is None and raises "FSDP needs a
non-CPU accelerator device" where there is none; Lightning passes ``root_device.index``, None
on CPU. :func:`allow_fsdp1_on_cpu` gives FSDP1 the CPU device in that case, so the strategy
shards, gathers and reduce-scatters on gloo as it does with NCCL on GPUs. Full state dicts
crash in FSDP1's clone of the unsharded parameters on CPU (a segmentation fault): the tests
use ``state_dict_type="sharded"``.
"""

from __future__ import annotations

import torch
from torch.distributed import fsdp


def allow_fsdp1_on_cpu() -> None:
    """In this process, ``FullyShardedDataParallel(module, device_id=None)`` shards on CPU."""
    base = fsdp.FullyShardedDataParallel
    if getattr(base, "on_cpu", False):
        return

    class CpuFSDP(base):
        on_cpu = True

        def __init__(self, module, *args, device_id=None, **kwargs):
            super().__init__(module, *args, device_id=torch.device("cpu") if device_id is None
                             else device_id, **kwargs)

    fsdp.FullyShardedDataParallel = CpuFSDP
