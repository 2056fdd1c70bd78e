"""How an arm's attempts ended, from its ranks' ``error`` and ``start`` records (standard
library only): the error that made each attempt fail, not the broken collectives that followed
it on the other ranks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any


def error_line(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """``OutOfMemoryError on rank 1 at step 31`` for the error that caused the last attempt
    that failed to fail (:func:`first_error_per_attempt`)."""
    if not errors:
        return None
    first = first_error_per_attempt(errors)[-1]
    rank = first.get("_rank", first.get("world_rank", "?"))
    return f"{first.get('error')} on rank {rank} at step {first.get('step')}"


def attempt_spans(starts: Sequence[Mapping[str, Any]], errors: Sequence[Mapping[str, Any]]
                   ) -> list[dict[str, Any]]:
    """Per attempt of rank 0, in the order they started: the step it started from
    (``start_step``, its checkpoint's) and, where it failed, the error that made it fail
    (:func:`first_error_per_attempt`): its short name, rank and step (the step that raised:
    the steps finished before it) and, for an out-of-memory error that recorded them, the
    fraction of the card the failed allocation would have filled (``needed_frac``)."""
    causes = {e.get("_try", -1): e for e in first_error_per_attempt(errors)}
    out = []
    for i, s in enumerate(sorted(starts, key=lambda r: r["wall"])):
        e = causes.get(i)
        needed, capacity = (e or {}).get("needed_bytes"), (e or {}).get("capacity_bytes")
        out.append({"attempt": i, "start_step": int(s.get("resumed_from") or 0),
                    "error": e and e.get("error"), "error_rank": e and e.get("_rank"),
                    "error_step": e and e.get("step"),
                    "needed_frac": round(needed / capacity, 4) if needed and capacity else None})
    return out


#: errors a rank raises because another rank failed first
CONSEQUENCES = ("DistBackendError", "RuntimeError", "KeyboardInterrupt", "SystemExit")


def first_error_per_attempt(errors: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Per attempt, in order, the error that caused it to fail: the earliest of its ranks'
    errors that is not a consequence of another rank's (a broken collective)."""
    groups: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for e in errors:
        groups[e.get("_try", -1)].append(e)
    return [min(groups[t], key=lambda e: (e.get("error") in CONSEQUENCES, e["wall"]))
            for t in sorted(groups)]
