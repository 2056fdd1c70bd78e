"""What runs inside every training worker: torch, psutil and Ray's worker APIs live here.

``data`` (the guarded DataLoader), ``guard`` (step timing, memory probes, the gate fed in
batches, the watchdog), ``dist`` (planned DDP / FSDP2, sharded checkpoints, bandwidth) are the
parts; ``loop`` (the shared train loop) and ``dropin`` (the drop-in's worker side) build on
them. Import-light: importing ``raytrain_guard.runtime`` alone pulls in neither torch nor ray.
"""
