"""The guarded DataLoader: sized from measured batches, sharded exactly once, resumable.
"""
