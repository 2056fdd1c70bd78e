"""Distributed training parts: planned DDP / ZeRO-1 / FSDP2 wrapping, sharded checkpoints, the
allreduce bandwidth curve."""
