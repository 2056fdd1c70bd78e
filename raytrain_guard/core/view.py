"""What the coordinator's policy reads and remembers (pure): each rank's recent steps and
setup (:class:`RankView`), the nodes' latest samples and the run's plan (:class:`ClusterView`),
and the state kept between rounds (:class:`PolicyState`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from raytrain_guard.config import GuardConfig
from raytrain_guard.core.columns import StepColumns
from raytrain_guard.core.decisions import Action, Cause, Decision
from raytrain_guard.core.effects import RunPlan
from raytrain_guard.core.node_samples import NodeSample, RunSetup
from raytrain_guard.core.stats import slope
from raytrain_guard.core.steps import StepStats
from raytrain_guard.core.straggler import TimingSummary, summarize_columns


@dataclass(slots=True)
class MemoryTrend:
    """A rank's latest device memory fraction, its step, and the window it came from."""

    frac: float
    step: int
    columns: StepColumns = field(repr=False, compare=False)

    @property
    def slope_per_step(self) -> float:
        """Least-squares slope per step over the window's readings (computed when read: the
        policy reads the worst rank's only)."""
        return slope(self.columns.memory_readings())


@dataclass(slots=True)
class RankView:
    """One rank as the coordinator knows it: its node, its recent steps (StepStats oldest
    first, or their columns, as the coordinator keeps them) and its setup. ``timing`` and
    ``memory`` summarize the window once, when the view is built (per report), so a policy
    round costs O(ranks), not O(steps)."""

    world_rank: int
    node_id: str
    window: Sequence[StepStats] | StepColumns
    setup: RunSetup = field(default_factory=RunSetup)
    columns: StepColumns = field(init=False, repr=False, compare=False)
    timing: TimingSummary = field(init=False, repr=False, compare=False)
    memory: MemoryTrend | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = self.window if isinstance(self.window, StepColumns) else StepColumns.of(self.window)
        self.columns, self.timing = c, summarize_columns(c)
        latest = c.latest_memory()
        self.memory = None if latest is None else MemoryTrend(latest[1], latest[0], c)


@dataclass(frozen=True)
class ClusterView:
    """Everything the policy looks at."""

    ranks: Mapping[int, RankView] = field(default_factory=dict)
    nodes: Mapping[str, NodeSample] = field(default_factory=dict)
    plan: RunPlan | None = None        # the memory model's inputs; None: actions unpriced
    #: node id -> its monitor's last host readings, (time_s, used fraction), oldest first
    host_readings: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)

    @property
    def latest_step(self) -> int | None:
        return max((r.columns.steps[-1] for r in self.ranks.values() if r.columns.steps),
                   default=None)


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between rounds: apply steps of its last actions."""

    last_release_step: int | None = None
    last_shrink_step: int | None = None
    prefetch_steps: Mapping[str, int] = field(default_factory=dict)   # node id -> apply step
    flagged_nodes: frozenset[str] = frozenset()    # whole nodes named (all their ranks slow)
    flagged_ranks: frozenset[int] = frozenset()    # ranks named, alone or with their node
    pacing: bool = False
    stop_step: int | None = None
    missed: frozenset[str] = frozenset()    # "action:cause" measured below its prediction:
                                            # not repeated for that cause (the policy escalates)
    release_armed: bool = True              # a release re-arms below the re-arm line, or when
                                            # the coordinator measured the last one a hit
    last_pace_step: int | None = None


@dataclass
class Round:
    """One policy round: what it reads (the view, the config, the step its decisions apply
    at) and what it has decided and noted so far."""

    view: ClusterView
    config: GuardConfig
    at: int
    decisions: list[Decision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @cached_property
    def latest(self) -> int | None:
        return self.view.latest_step

    def cooled(self, last_apply_step: int | None) -> bool:
        """Whether ``decision_cooldown_steps`` passed since an action's apply step (or it never
        ran)."""
        latest = self.latest
        return last_apply_step is None or (
            latest is not None and latest >= last_apply_step + self.config.decision_cooldown_steps)


def missed_key(action: Action, cause: Cause, scope: str = "cluster") -> str:
    """The key a decision that missed its prediction is remembered by in
    ``PolicyState.missed``: ``action:cause``, and ``@node`` for a node's prefetch change."""
    key = f"{action.value}:{cause.value}"
    if action is Action.SET_PREFETCH and scope.startswith("node:"):
        key += "@" + scope.split(":", 1)[1]
    return key


SHORT_NODE_ID_CHARS = 8
"""Characters of a node id kept in messages: Ray's 56-hex-digit ids differ in their first
eight (params and state keep the full id)."""


def short_node_id(node_id: str) -> str:
    """``node_id`` as messages print it: its first 8 characters, with "..." when cut.
    Example: "a1b2c3d4e5f6..." (56 hex digits) -> "a1b2c3d4..."; "n1" -> "n1"."""
    return node_id if len(node_id) <= SHORT_NODE_ID_CHARS + 3 else \
        node_id[:SHORT_NODE_ID_CHARS] + "..."


def rank_gpu(view: ClusterView, world_rank: int) -> int | None:
    """The GPU index a rank runs on: its reported ``device_index``, else the GPU of its node's
    sample whose processes include the rank's registered pid; None when neither tells."""
    rv = view.ranks[world_rank]
    if rv.setup.device_index is not None:
        return rv.setup.device_index
    node = view.nodes.get(rv.node_id)
    if node is None or node.host is None:
        return None
    pids = {w.pid for w in node.host.workers if w.world_rank == world_rank}
    for gpu in node.gpus:
        if pids.intersection(gpu.process_pids or ()):
            return gpu.index
    return None
