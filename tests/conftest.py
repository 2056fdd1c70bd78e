"""Shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:      # the tests import examples/ (and spawned ranks inherit it)
    sys.path.insert(0, str(ROOT))

from ray_head import TRAIN_POLL_ENV  # tests/ is on sys.path once pytest runs

for key, value in TRAIN_POLL_ENV.items():    # every Ray cluster a test starts inherits it
    os.environ.setdefault(key, value)


@pytest.fixture(scope="module")
def ray_instance(request):
    """A local Ray instance for one test module, shut down after it; yields its GCS address.

    Train workers unpickle ``examples.toy`` by value, so they need not import ``examples/``.
    A module may set ``RAY_NAMESPACE`` (named actors it looks up) and ``RAY_NUM_CPUS``
    (default 4: two train workers, their controller and the guard's actors).
    """
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from examples import toy

    cloudpickle.register_pickle_by_value(toy)
    ray.init(address="local", namespace=getattr(request.module, "RAY_NAMESPACE", None),
             num_cpus=getattr(request.module, "RAY_NUM_CPUS", 4), include_dashboard=False,
             logging_level="warning", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(items):
    """The modules that start Ray in this process (a ``ray`` mark on any of their tests) run
    after the others, in their order. A Ray driver leaves gRPC threads behind after
    ``ray.shutdown()``, and gRPC does not support ``fork()`` after its objects exist
    (grpc/grpc doc/fork_support.md): a DataLoader worker forked by a later test in this
    process now and then aborted ("double free or corruption"), about 1 suite run in 10."""
    ray_modules = {item.nodeid.split("::")[0] for item in items
                   if item.get_closest_marker("ray") is not None}
    items.sort(key=lambda item: item.nodeid.split("::")[0] in ray_modules)
