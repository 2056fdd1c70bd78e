"""The capacity planner: will a job fit, and with which settings. The capacity math is pure
(standard library only); ``trace``, ``batch_inspect`` and ``batches`` are the torch adapters
that measure a user's model and data for it.
"""
