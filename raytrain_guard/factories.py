"""Resolve the user's factories: ``"package.module:attr"`` strings or callables.

One place for the CLI (``--model/--sample/--loss``), the tracer and the train loop template
(``model_factory``, ``dataset_factory``, ...), so every entry point gives the same one-line error
naming the field, the value and the fix.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from raytrain_guard.errors import InputError, one_line


def load_object(spec: str | Callable[..., Any], *, field_name: str,
                error: type[InputError] = InputError) -> Callable[..., Any]:
    """``"package.module:attr"`` (dots allowed in ``attr``), or a callable returned as is.

    Raises ``error`` (an :class:`InputError` subclass) naming ``field_name`` when the string is
    malformed, the module does not import, the attribute is missing or not callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise error(field_name, "not a 'module:attr' reference or a callable", value=spec,
                    fix="write it as package.module:function, e.g. examples.models:mlp")
    module_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's input
        raise error(field_name, f"cannot import module {module_name!r} ({one_line(exc)})",
                    value=spec, fix="check the module path and that it imports; it must be "
                                    "importable where it runs (the working directory, or a Ray "
                                    "runtime_env working_dir/py_modules on the workers)") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(field_name, f"module {module_name!r} has no attribute {attr!r}",
                        value=spec, fix="name a function or class defined in that module") \
                from None
    if not callable(obj):
        raise error(field_name, f"{attr!r} is not callable", value=spec,
                    fix="name a function (or class) to call")
    return obj
