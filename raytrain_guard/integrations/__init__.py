"""The guard inside the trainers Ray Train users run: Hugging Face ``Trainer``
(:mod:`raytrain_guard.integrations.transformers`) and Lightning
(:mod:`raytrain_guard.integrations.lightning`). Each module needs its framework, installed with
the extra of the same name (``pip install 'raytrain-guard[transformers]'``, ``[lightning]``);
without it, importing the module raises :class:`MissingExtra`, one line naming the extra.
docs/integrations.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from raytrain_guard.errors import GuardError


class MissingExtra(GuardError, ImportError):
    """An integration's framework is not installed: the one line names the pip extra."""


def require(module: str, extra: str, integration: str) -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` naming ``extra`` (no chained traceback)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{integration} needs {module}, which is not installed ({exc}); "
                           f"pip install 'raytrain-guard[{extra}]'") from None
