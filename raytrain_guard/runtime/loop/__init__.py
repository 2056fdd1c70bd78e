"""The shared train loop's parts, one responsibility a module; :mod:`raytrain_guard.runtime.loop.train_loop`
joins them into :class:`~raytrain_guard.runtime.loop.train_loop.GuardedTrainLoop`."""
