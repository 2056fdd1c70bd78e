"""What the tests that start a Ray head of their own (``ray start --head``) share.

The head runs under the tests' own interpreter (``python -m ray.scripts.scripts``), never the
``ray`` found on PATH: that one may belong to another Python (a virtual environment with the
system's site packages finds the system's), whose workers import another copy of the package,
or none.
"""

from __future__ import annotations

import random
import socket
import sys

RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]

# Ray Train's controller polls its workers every 2 s, and each checkpoint's report and a run's
# end wait for a poll: of an 8-step test run's ~27 s, about 10. At 0.25 s the same run takes
# ~16 s. conftest sets it in the tests' environment, which the Ray clusters they start
# (local, ``ray.cluster_utils.Cluster``, ``ray start`` children) inherit; the demo's smoke test
# leaves it to the demo, which sets it for its embedded cluster, as a user's run does.
TRAIN_POLL_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}


def free_ports(n: int) -> list[int]:
    """n ports free now, between Ray's worker ports (10002-19999) and the ephemeral range."""
    ports: list[int] = []
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("no free ports between 20000 and 32000")
