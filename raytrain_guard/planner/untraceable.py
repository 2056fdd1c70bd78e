"""Why a model could not be traced, in one line: the trace's failures sorted by kind (the
sample does not fit the model's input, a forward that needs values, anything else) into the
:class:`~raytrain_guard.errors.TraceError` the user reads, and the seams that catch them (the
last aten op run, the user's factory raising, FakeTensorMode's own tracebacks kept quiet).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping

from raytrain_guard.errors import TraceError, one_line


class OpFailure(Exception):
    """The model failed while running on a fake/meta device (message names the op).

    ``where`` says what failed ("operation aten.mm.default", "building the model"), ``exc`` is
    the exception PyTorch or the user's code raised there."""

    def __init__(self, where: str, exc: BaseException, prefix: str = "") -> None:
        super().__init__(f"{prefix}{where} failed: {one_line(exc)}")
        self.where, self.exc = where, exc


# Failures that come from the sample not fitting the model's forward: PyTorch's shape/dtype
# checks (matmul, conv, norm, embedding, RNN, view, broadcasting) and a wrong argument count.
_MISMATCH = re.compile("|".join((
    r"shapes cannot be multiplied", r"must have (the )?same reduction dim", r"size mismatch",
    r"expected\b.*\binput", r"to have \d+ channels", r"invalid channel dimensions",
    r"must be equal to input_size", r"normalized_shape", r"must match the size of tensor",
    r"is invalid for input of size", r"dimension out of range", r"same dtype",
    r"expected scalar type", r"scalar types?\b.*\bbut got", r"does not match",
    r"forward\(\) (takes|missing|got an unexpected)", r"input.* must have \d+ dim",
)), re.IGNORECASE)

# Failures that come from a forward that needs values, not shapes.
_DATA_DEPENDENT = re.compile("|".join((
    r"DataDependent", r"DynamicOutputShape", r"_local_scalar_dense",
    r"cannot be called on meta tensors", r"copy out of meta tensor", r"numpy", r"nonzero",
    r"data.dependent",
)), re.IGNORECASE)


def _failure_kind(exc: BaseException) -> str:
    """The kind of a trace failure: "data-dependent", "mismatch" (the sample does not fit the
    model's input) or "other"."""
    text = f"{type(exc).__name__}: {exc}"
    if _DATA_DEPENDENT.search(text):
        return "data-dependent"
    if isinstance(exc, (RuntimeError, ValueError, AssertionError, IndexError, TypeError)) \
            and _MISMATCH.search(str(exc).strip().split("\n", 1)[0]):
        return "mismatch"
    return "other"


def untraceable(failures: list[OpFailure], errors: list[str],
                 names: Mapping[str, str]) -> TraceError:
    """The TraceError for a model that ran on neither device, by kind of failure."""
    kinds = [_failure_kind(f.exc) for f in failures]
    if "mismatch" in kinds:
        failure = failures[kinds.index("mismatch")]
        return TraceError("sample", f"does not fit the input of model {names['model']}: "
                          f"{failure.where} failed with {one_line(failure.exc)}",
                          value=names["sample"],
                          fix=f"pass a --sample factory that returns what {names['model']}'s "
                              "forward takes (shape and dtype, batch first; a tuple/dict for "
                              "several arguments)")
    if "data-dependent" in kinds:
        return TraceError("model", "cannot be traced on the fake or the meta device ("
                          + "; ".join(errors) + ")", value=names["model"],
                          fix="make the failing operation shape-only (no .item(), .tolist(), "
                              "numpy() or data-dependent Python branches in forward), or plan "
                              "with --params / --layers instead")
    failure = failures[0]
    return TraceError("model", "cannot be traced on the fake or the meta device: "
                      f"{failure.where} failed with {one_line(failure.exc)}",
                      value=names["model"],
                      fix="check that one training step runs on a real sample (model factory "
                          "and --sample together), or plan with --params / --layers instead")


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """For one trace attempt only, drop FakeTensorMode's ``log.exception`` of a failing op: the
    trace re-raises it as one TraceError line, so the logged traceback is only noise."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")

    def drop(record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info)

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def call_factory(fn, field_name: str, spec_name: str, **kwargs):
    try:
        return fn(**kwargs)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory raised
        raise FactoryError(field_name, spec_name, exc) from exc


class FactoryError(Exception):
    def __init__(self, field_name: str, spec_name: str, exc: BaseException) -> None:
        super().__init__(one_line(exc))
        self.field_name, self.spec_name, self.exc = field_name, spec_name, exc


def looks_like_fake_issue(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(w in text for w in ("Fake", "fake", "DataDependent", "meta", "mode"))


def last_op_recorder():
    """A dispatch mode that remembers the last aten op (``last``), to name it when one fails;
    ``entered``: whether the model's step got as far as entering it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LastOp(TorchDispatchMode):
        last: str | None = None
        entered = False

        def __enter__(self):
            self.entered = True
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.last = str(func)
            return func(*args, **(kwargs or {}))

    return LastOp()
