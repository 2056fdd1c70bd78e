"""A rehearsal ``decision_source`` for tests: scripted decisions handed to each rank at the steps
the script says, as a coordinator would deliver them (at different times on different ranks).

Train workers unpickle it by value: a test that ships it to Ray workers calls
``ray.cloudpickle.register_pickle_by_value(scripted_source)`` first."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_guard.coordination.context import current_context
from raytrain_guard.core.decisions import Decision
from raytrain_guard.errors import InputError


class ScriptedDecisionSource:
    """``script`` maps a world rank to ``[(poll_step, decision dict), ...]``: at boundary
    ``poll_step`` that rank's ``poll`` returns the decision (``Decision.to_dict()`` form). The
    loop applies it at the decision's own ``step`` (or at once when it has none or it is past),
    so a decision handed to the ranks at different steps but carrying one ``step`` is applied
    in lockstep, which is what ``LockstepDecisionSource`` guarantees for real. The rank is read
    from the worker context on the first poll. Every scripted decision is read when the script
    is given: one that is no decision (a shrink for one node's ranks included) raises an
    InputError naming its entry.
    """

    def __init__(self, script: Mapping[int, Sequence[tuple[int, Mapping[str, Any]]]]) -> None:
        self.script = {int(rank): [(int(at), dict(d)) for at, d in entries]
                       for rank, entries in script.items()}
        for rank, entries in self.script.items():
            for index, (_, d) in enumerate(entries):
                _scripted_decision(f"script[{rank}][{index}]", d)
        self.world_rank: int | None = None
        self.setups: list[tuple[int, dict[str, Any]]] = []   # (step, setup) seen at each poll
        self._setup: Callable[[], Mapping[str, Any]] | None = None

    def bind_setup(self, setup: Callable[[], Mapping[str, Any]]) -> None:
        self._setup = setup

    def poll(self, step: int, stats: Any = None) -> list[Decision]:
        if self.world_rank is None:
            self.world_rank = current_context().world_rank
        if self._setup is not None:
            self.setups.append((step, dict(self._setup())))
        return [Decision.from_dict(d) for at, d in self.script.get(self.world_rank, ())
                if at == step]


def _scripted_decision(field: str, d: Mapping[str, Any]) -> Decision:
    """``d`` as a Decision, or an InputError naming ``field`` (the script's entry)."""
    try:
        return Decision.from_dict(d)
    except InputError as err:
        raise InputError(f"{field}.{err.field}", err.problem, value=err.value,
                         fix=err.fix) from None
    except (KeyError, ValueError, TypeError) as err:
        raise InputError(field, f"is not a decision ({err!r})", value=dict(d),
                         fix="script Decision.to_dict() forms") from None
