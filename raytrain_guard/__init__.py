"""raytrain_guard: keeps distributed PyTorch training on Ray inside its resource limits.

Three capabilities:

1. Before launch: :func:`raytrain_guard.plan` (the capacity planner) answers "will it fit?".
2. During the run: the guarded DataLoader, the planned DDP/FSDP and the step gate in every
   TorchTrainer worker (``raytrain_guard.runtime``); the shared train loop is
   :func:`raytrain_guard.train_loop_per_worker`, the drop-in :mod:`raytrain_guard.train`.
3. Across the cluster: node monitors and a coordinator (``raytrain_guard.cluster``) that apply
   every decision on all ranks at the same step.

Importing the package is cheap: torch and ray are imported only by the adapters that need them.
"""

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.errors import ConfigError, GuardError, InputError
from raytrain_guard.planner.plan import Plan, plan

__version__ = "0.1.0"

__all__ = ["GuardConfig", "Action", "Cause", "Decision", "GuardError", "InputError",
           "ConfigError", "Plan", "plan", "train_loop_per_worker", "__version__"]


def __getattr__(name: str):
    """``raytrain_guard.train_loop_per_worker``, imported on first use (it pulls in torch)."""
    if name == "train_loop_per_worker":
        from raytrain_guard.runtime.loop.train_loop import train_loop_per_worker
        return train_loop_per_worker
    raise AttributeError(f"module 'raytrain_guard' has no attribute {name!r}")
