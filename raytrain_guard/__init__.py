"""raytrain_guard: keeps distributed PyTorch training on Ray inside its resource limits.

Three capabilities:

1. Before launch: :func:`raytrain_guard.plan` (the capacity planner) answers "will it fit?".
2. During the run: the guarded DataLoader, the planned DDP/FSDP and the step gate in every
   TorchTrainer worker (``raytrain_guard.runtime``).
3. Across the cluster: node monitors and a coordinator (``raytrain_guard.cluster``) that apply
   every decision on all ranks at the same step.

Importing the package is cheap: torch and ray are imported only by the adapters that need them.
"""

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.planner import Plan, plan
from raytrain_guard.errors import ConfigError, GuardError, InputError

__version__ = "0.1.0"

__all__ = ["GuardConfig", "Action", "Cause", "Decision", "GuardError", "InputError",
           "ConfigError", "Plan", "plan", "__version__"]
