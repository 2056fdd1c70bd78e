"""The one validated configuration of the guard (pure: standard library only).

Every threshold the guard uses lives here, with the rule its default comes from. Build it from
Python (``GuardConfig(headroom_frac=0.2)``) or from a TOML file (``GuardConfig.from_toml(path)``);
unknown keys and out-of-range values raise :class:`~raytrain_guard.errors.ConfigError` naming
the field and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from raytrain_guard.errors import ConfigError
from raytrain_guard.units import GiB

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as _toml  # type: ignore[no-redef]


def _doc(default: Any, text: str, lo: float | None = None, hi: float | None = None, *,
         lo_open: bool = False) -> Any:
    """A field with its default, its docstring and its valid range (checked in __post_init__)."""
    return field(default=default,
                 metadata={"doc": text, "lo": lo, "hi": hi, "lo_open": lo_open})


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """Every threshold of raytrain_guard, defaults from the seed rules."""

    # -- capacity planning -------------------------------------------------------------------
    headroom_frac: float = _doc(
        0.15, "Fraction of device memory kept free: static memory + activations + reserve must fit in "
        "(1 - headroom_frac) of the card. Seed rule: 15 % headroom.", 0.0, 0.9)
    host_prefetch_frac: float = _doc(
        0.05, "Fraction of host RAM, per GPU, that prefetched batches (num_workers x prefetch_factor "
        "x batch bytes, plus pinned copies) may occupy. Seed rule: 5 % of host RAM per GPU.",
        0.0, 0.5, lo_open=True)
    cuda_context_bytes: int = _doc(
        1 * GiB, "Device memory outside PyTorch's caching allocator: the CUDA context with its loaded "
        "kernels and NCCL's communicator buffers; part of the runtime reserve, and what the CUDA "
        "memory probe adds to the allocator's counters. (cuBLAS and cuDNN take their workspaces "
        "from the allocator, which counts them.) Default 1 GiB: a CUDA 12 context with lazy "
        "module loading plus NCCL communicators on a Hopper card measures 0.5-1 GiB.", 0)
    fragmentation_frac: float = _doc(
        0.05, "Caching-allocator fragmentation, as a fraction of the tensor peak; part of the runtime "
        "reserve. Default 5 %: PyTorch's expandable segments keep reserved-over-allocated "
        "within a few percent on steady training loops.", 0.0, 1.0)
    min_workers_per_gpu: int = _doc(
        2, "Lower clamp of DataLoader num_workers per GPU. Seed rule: workers clamped to [2, 8].", 0)
    max_workers_per_gpu: int = _doc(
        8, "Upper clamp of DataLoader num_workers per GPU. Seed rule: workers clamped to [2, 8].", 1)
    max_prefetch_factor: int = _doc(
        8, "Largest prefetch_factor the planner proposes: deeper queues only hold memory once "
        "the loader keeps up. Default 8, twice the seed's fixed 4.", 1)
    target_num_buckets: int = _doc(
        8, "Number of DDP buckets the bucket-size recommendation aims for, so the allreduce of "
        "early buckets overlaps the rest of backward. Default 8: below about 4 buckets the "
        "last bucket's allreduce is exposed; far above, per-call latency dominates.", 1)
    min_bucket_cap_mb: float = _doc(
        1.0, "Smallest bucket_cap_mb recommended (MiB): below it per-allreduce latency dominates. "
        "Default 1 MiB, the size DDP gives its own first bucket.", 0.0, lo_open=True)
    max_bucket_cap_mb: float = _doc(
        256.0, "Largest bucket_cap_mb recommended (MiB). Default 256 MiB: beyond it an allreduce "
        "delays its overlap with backward more than it saves in latency.", 0.0, lo_open=True)
    bandwidth_peak_frac: float = _doc(
        0.8, "With a measured allreduce bandwidth curve, the bucket size is the smallest message "
        "that reaches this fraction of the peak bus bandwidth. Default 0.8.", 0.0, 1.0,
        lo_open=True)
    num_buckets_in_flight: int = _doc(
        2, "DDP bucket buffers the bucket-size memory bound assumes alive at once beyond the "
        "planned memory: one being all-reduced while the next one fills. Default 2, DDP's "
        "overlap of one allreduce with the rest of backward.", 1)
    list_dataset_min_items: int = _doc(
        1024, "A dataset attribute that is a Python list, tuple or dict with at least this many "
        "items marks the dataset as list-backed (copy-on-read growth in forked DataLoader "
        "workers). Default 1024: below it the refcount pages touched stay under a few MiB.", 1)

    # -- step gate ---------------------------------------------------------------------------
    memory_watermark_frac: float = _doc(
        0.88, "Memory fraction at which the gate releases cached blocks. Seed rule: watermark 0.88.",
        0.0, 1.0, lo_open=True)
    memory_critical_frac: float = _doc(
        0.90, "Memory fraction at which the gate escalates (cluster action, or checkpoint before an "
        "out-of-memory). Seed rule: critical 0.90.", 0.0, 1.0, lo_open=True)
    num_slow_steps: int = _doc(
        3, "Consecutive slow steps that raise a slow-step event. Seed rule: 3 in a row.", 1)
    slow_step_factor: float = _doc(
        1.5, "A step is slow when it takes longer than this multiple of the recent median step. "
        "Default 1.5: DDP step jitter on a healthy node stays well below it.", 1.0, lo_open=True)
    slow_step_abs_s: float | None = _doc(
        None, "Optional absolute slow-step threshold in seconds; none (the key left out of a TOML "
        "file, None in Python) uses only the relative rule.",
        0.0, lo_open=True)
    step_window: int = _doc(
        50, "Number of recent steps kept for the median and the attribution. Default 50.", 3)
    cpu_memory_budget_bytes: int | None = _doc(
        None, "On CPU (no CUDA), the process-memory budget the watermark is measured against. None "
        "(the key left out of a TOML file): the host RAM divided by the local world size.", 1)
    pacing_enabled: bool = field(default=False, metadata={
        "doc": "Enable the seed's pacing delay (a sleep before each step under pressure). Off "
               "by default: it trades throughput for memory and is a last resort."})
    pacing_delay_s: float = _doc(
        0.05, "Pacing delay per step when enabled. Default 50 ms.", 0.0)
    memory_hysteresis_frac: float = _doc(
        0.03, "After a cache release the watermark rule re-arms only once the memory fraction falls "
        "below memory_watermark_frac minus this. Default 0.03 (re-arm below 0.85): a loop that "
        "hovers at the watermark releases once per crossing, not every step.", 0.0, 0.5)
    release_cache_min_interval_s: float = _doc(
        5.0, "Least time between two cache releases of one rank, whatever the hysteresis says. "
        "Default 5 s: torch.cuda.empty_cache synchronizes the device and the next steps pay to "
        "re-allocate, so releasing more often costs more than it frees.", 0.0)
    memory_read_every_steps: int = _doc(
        4, "Host-memory probes under StepGuard's fast path (a host step timer, the gate's quiet "
        "bounds known): a reading more than 0.05 below memory_watermark_frac is reused for the "
        "next steps and the probe read again every this many steps, or less often the farther "
        "below the line the reading is (up to 4x this many steps: as long as memory growing by "
        "0.05 / this many steps of the budget per step stays under the line); a reading at or "
        "above that line is taken every step. Default 4: the /proc read was the largest part of "
        "the guard's cost next to a ~10 ms CPU step; 5 points of the budget is more than a steady "
        "loop grows in 4 steps, and a jump past the line is seen at most 15 steps late (3 near "
        "it). 1: read every step. Device probes and the first steps (no quiet bounds yet) are "
        "read every step.", 1)
    gate_batch_steps: int = _doc(
        20, "StepGuard's fast path (a host step timer): steps that cannot decide anything wait and "
        "reach the gate together at least every this many steps. Default 20: feeding the gate "
        "has a fixed cold-cache cost (about 0.1 ms next to a ~10 ms CPU step, more than the "
        "per-step part) that 20 steps share; capped at step_window // 2 - 5 so that the quiet "
        "bound stays 1.5x at least the sixth fastest step of the window. 1: every step goes to "
        "the gate at once. Decisions come at the same steps whatever the value.", 1)
    memory_trend_steps: int = _doc(
        5, "Recent memory readings the gate fits a line through (least squares) to predict the "
        "memory fraction ahead. Default 5: enough points to ignore one noisy reading.", 2)
    memory_predict_steps: int = _doc(
        3, "Above the watermark, the gate escalates to checkpoint-and-stop when the memory trend "
        "reaches memory_critical_frac within this many steps, so the worker checkpoints before "
        "it would run out. Default 3; 0 disables the prediction (only the reading escalates).",
        0)
    slow_step_warmup_steps: int = _doc(
        2, "First steps the slow-step rules ignore (kept out of the median). Default 2: DDP's first "
        "step uses one big bucket and rebuilds its buckets, lazy initialisation and compilation "
        "happen then too.", 0)
    slow_step_settle_steps: int = _doc(
        3, "Steps after a checkpoint, and after a restore from one, that the slow-step rules "
        "ignore (kept out of the median), as the first steps of a run: the checkpoint's "
        "aftermath (the controller's bookkeeping, an asynchronous upload) competes with them, "
        "and a restored run starts in fresh processes. Default 3: on the 2-core CI box the "
        "three steps after a checkpoint ran twice their compute on both ranks: one of the two "
        "slow-step events in 7,200 clean rank-steps of the built-in experiment model.", 0)
    slow_step_host_wait_frac: float = _doc(
        0.5, "A slow step whose training thread waited for a CPU (runnable, not running: "
        "StepStats.cpu_wait_s, from /proc/thread-self/schedstat) for at least this fraction of "
        "the step's excess over the recent median (for a step slow in communication: or "
        "with the wait of the rank of the node that waited most, StepStats.peer_cpu_wait_s: "
        "this one waited for it) is the host's contention (another process, too many loader "
        "workers), not the rank's slowdown: it does not count toward a run of slow steps and "
        "ends the one it fell in (StepGate.num_host_starved counts it); the coordinator's "
        "straggler rule leaves such a rank-step out too. 0 turns the rule off. "
        "Default 0.5: a step that shares its core with one busy thread runs at half speed and "
        "waits as long as it grew (ratio 1); a slow device, link or data source makes the "
        "thread wait voluntarily (ratio 0).", 0.0)
    slow_step_host_settle_steps: int = _doc(
        3, "Steps after a host-starved step (slow_step_host_wait_frac) that the slow-step "
        "rules ignore, as after a checkpoint; the starved step also ends the run of slow steps "
        "it fell in (the run's first step is not read for a CPU wait: it was the contention's "
        "start). A burst of contention has an aftermath: the starved rank's cold caches and "
        "its catch-up show as compute on it and as communication wait on the others, with "
        "neither thread waiting for a CPU. A step slow against the starved one itself "
        "(slow_step_factor x its time) is judged as usual. Default 3 (as "
        "slow_step_settle_steps): replayed over 30 clean 600-step arms of the 2-core CI box "
        "(benchmarks/gate_replay.py), 3 slow-step events with 0, 1 with 3; over 140 arms with "
        "an injected fault, 2 named one step later, none missed. 0: no settling.", 0)
    slow_step_peer_work_frac: float = _doc(
        0.5, "A step slow in communication while another rank of this node did more work in "
        "it (its step time less its communication wait, StepStats.peer_work_s, from the "
        "node's shared board) than this one by at least this fraction of the step's excess "
        "over the recent median waited for that rank in the collective: neither this rank's slowdown nor its link's, and that "
        "rank's own gate judges it. It does not count toward a run of slow steps and ends one "
        "not yet named (StepGate.num_waited_for_peer counts it). 0 turns the rule off. Default "
        "0.5 (as slow_step_host_wait_frac): under DDP the waiting rank's communication wait "
        "grows by the other's extra work; a slow link or a congested one grows it with no "
        "rank's work grown. Ranks on other nodes are not seen.", 0.0)
    pause_gap_steps: float = _doc(
        3.0, "Time between two steps (the loop's, after one step closed and before the next "
        "began) longer than this many median steps is a pause, a checkpoint or an evaluation, "
        "and the steps after it settle as after the train loop's own checkpoints "
        "(slow_step_settle_steps), also where the guard does not see the pause (the drop-in "
        "API and the user's ray.train.report). Default 3: a loop that synchronizes with the "
        "GPU between steps (loss.item()) waits there about one step at most.", 0.0,
        lo_open=True)
    straggler_frac: float = _doc(
        0.10, "Across ranks, a rank is a straggler when its compute (or data wait) exceeds the other "
        "ranks' median by more than this fraction of their median step time, and waiting when "
        "its communication wait exceeds the least one by as much. Default 10 %.", 0.0,
        lo_open=True)
    straggler_steps: int = _doc(
        20, "The coordinator names a rank (or node) a straggler when it is slower than the "
        "reference rank by its threshold (straggler_frac, slow_step_floor_s, slow_step_mad_k) over "
        "this many consecutive steps, at all of them but one in ten (a step another rank's "
        "outlier shortens; the first and the last over it). Default 20, two report batches at the default "
        "report_every_steps: a straggler stays slow, while the longest such run in 116 clean "
        "600-step 2-rank arms on a 2-core box was 10 steps (3 gave 20 flags, 10 gave 1, 11 and "
        "more none: benchmarks/gate_replay.py --coordinator). The step gate still names a "
        "slowdown within num_slow_steps on the slow rank itself.", 1)

    # -- guarded DataLoader ------------------------------------------------------------------
    loader_probe_samples: int = _doc(
        8, "Samples (dataset[0..k-1]) the guarded DataLoader reads and collates in the training "
        "process before starting workers, to measure batch bytes (scaled to the batch size) and "
        "check that samples agree in type and shape. Default 8: enough to catch a mixed dataset, "
        "cheap next to one batch.", 1)
    worker_memory_interval_s: float = _doc(
        5.0, "Interval of the background sampling of the DataLoader workers' private memory (USS). "
        "Default 5 s, so reading /proc/<pid>/smaps stays far below 1 % of one core.", 0.0,
        lo_open=True)
    worker_memory_growth_samples: int = _doc(
        5, "Consecutive non-decreasing worker-memory samples that count as steady growth "
        "(copy-on-read). Default 5: 20 s of climbing at the default interval.", 2)
    worker_memory_growth_bytes: int = _doc(
        64 * 1024**2, "Least growth of the workers' summed private memory across those samples "
        "that warns of copy-on-read. Default 64 MiB: allocator warm-up stays well below it; a "
        "list-backed dataset of a few hundred MiB passes it within one epoch.", 1)

    # -- cluster -----------------------------------------------------------------------------
    monitor_interval_s: float = _doc(
        1.0, "Node monitor sampling interval. Default 1 s.", 0.0, lo_open=True)
    report_every_steps: int = _doc(
        10, "Steps per batch of statistics a rank sends to the coordinator. Default 10.", 1)
    lockstep_every_steps: int = _doc(
        10, "Every K steps the ranks agree on pending decisions through one tiny collective; a "
        "decision is applied at the next multiple of K. Default 10.", 1)
    checkpoint_every_steps: int = _doc(
        200, "Steps between checkpoints of the shared train loop. Default 200.", 1)
    decision_interval_s: float = _doc(
        1.0, "Coordinator policy round interval: the policy runs at most this often, on the "
        "reports that arrive. Default 1 s, the monitors' sampling interval.", 0.0)
    decision_cooldown_steps: int = _doc(
        20, "Steps after a cluster action's apply step before the same action may be decided "
        "again (or escalated): the reports must show its effect first. Default 20, two report "
        "batches at the default report_every_steps=10.", 1)
    host_memory_watermark_frac: float = _doc(
        0.90, "Host memory used fraction (1 - available/total) at which the policy lowers the "
        "node's prefetch depth. Default 0.90: five points below Ray's memory monitor, which "
        "kills workers at 0.95 (RAY_memory_usage_threshold).", 0.0, 1.0, lo_open=True)
    coordinator_retry_s: float = _doc(
        5.0, "Least time between two lookups of the coordinator by name, by a rank's client or a "
        "node monitor, after the coordinator was unreachable. Default 5 s: Ray restarts a killed "
        "actor within a few seconds, and one failed lookup per 5 s is free next to a step.",
        0.0)
    node_sample_max_age_intervals: int = _doc(
        10, "A node sample older than this many monitor_interval_s no longer counts in the "
        "policy (its monitor died or cannot reach the coordinator). Default 10: ten missed "
        "samples, far beyond the jitter of a 1 s sampling thread.", 1)
    straggler_min_steps: int = _doc(
        3, "Steps a rank's window must hold before the coordinator scores it as a straggler. "
        "Seed rule: 3 consecutive slow steps (as num_slow_steps).", 1)
    oom_stop_frac: float = _doc(
        0.98, "Device memory fraction, projected to the step after the next apply step, at which "
        "the policy checkpoints and stops before an out-of-memory. Default 0.98: one more "
        "activation-sized allocation from the end of the card.", 0.0, 1.0, lo_open=True)
    hang_floor_s: float = _doc(
        10.0, "Least time a step may run before the hang watchdog names its rank and ends the "
        "attempt. Default 10 s: well under the 30 min collective timeout Ray Train sets, well "
        "over a checkpoint-free step of the models this guard plans.", 0.0, lo_open=True)
    hang_step_multiple: float = _doc(
        20.0, "A step running longer than this multiple of the rank's median step (or "
        "hang_floor_s, whichever is longer) is a hang. Default 20: a step 20 times its median "
        "is no slowdown the step gate would act on.", 1.0)

    # -- noise and effects: decisions that know their effect -----------------------------------
    slow_step_floor_s: float = _doc(
        0.002, "Absolute floor under a slowdown: a step is slow only when it exceeds the recent "
        "median by at least this many seconds, and a rank is a straggler only when it adds at "
        "least this much per step over the reference rank. Default 2 ms: a clean "
        "2-rank CPU run flagged a rank for 0.4 ms of a 4 ms step; clean CPU steps measured on "
        "the 2-core CI box jitter by 0.04-0.16 ms (MAD), and the smallest slowdown the guard "
        "must name (x2.5 compute on a 3 ms step) adds 4.5 ms.", 0.0)
    slow_step_mad_k: float = _doc(
        3.5, "Robust spread: a step is slow only when it exceeds the recent median by this many "
        "robust standard deviations (1.4826 x the median absolute deviation), and a rank's "
        "excess over the reference must clear this many of its own. Default 3.5: Iglewicz and "
        "Hoaglin's cut-off for the modified z-score.", 0.0)
    slow_component_growth_steps: float = _doc(
        1.0, "A step is also slow when the rank's own data wait or compute grew over its recent "
        "median by this many median steps, by slow_step_floor_s and by slow_step_mad_k robust "
        "spreads of its own, the whole step by the floor at least: a straggler's compute grows "
        "while its wait for the others shrinks, so its step grows less than its compute. 0 "
        "turns the rule off. Default 1.0 (the part alone would double the step): replayed "
        "through the gate (benchmarks/gate_replay.py), 28 experiment arms with x3 compute on "
        "one rank name it within 5 steps in 20 (9 on the whole step alone), and 17300 clean "
        "rank-steps give 20 events against 21. Where slow_step_abs_s is the lower line, that "
        "rule alone decides.", 0.0)
    slow_step_adaptive_persistence: bool = field(default=True, metadata={
        "doc": "A run of slow steps must also outlast every streak of slow steps that ended by "
               "itself within the last step_window steps (at most 3 x num_slow_steps), so a box "
               "whose noise comes in streaks is not named slow at each one. Default on: "
               "a 2-core box with a third busy process alternates normal and ~2.4x steps in "
               "streaks of 3-7 (measured: 34 and 27 gate events in 650 steps with 3 in a row, 9 "
               "and 10 with this). On a clean box it asks num_slow_steps (the seed rule)."})
    cache_release_min_frac: float = _doc(
        0.05, "A cache release is decided (by the coordinator and by a rank's own gate) only "
        "when the rank's allocator holds at least this fraction of the card cached but "
        "unallocated (reserved - allocated): never on CPU or a simulated card, which have no "
        "allocator cache; a reading that does not tell the cache leaves it to the watermark "
        "rule alone. Default 5 %: the "
        "fragmentation reserve the planner sets aside (fragmentation_frac); less is the "
        "allocator's normal slack, not worth a device synchronization on every rank.", 0.0, 1.0)
    effect_min_share: float = _doc(
        0.5, "An action whose measured effect (over decision_cooldown_steps after its apply "
        "step) is below this share of its predicted effect is not repeated for that cause; the "
        "policy escalates. Default 0.5: an action that delivers less than half its prediction missed.", 0.0, 1.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
            if lo is None and hi is None:
                if f.type in ("bool",) and not isinstance(value, bool):
                    raise ConfigError(f.name, "must be true or false", value=value,
                                      fix="write true or false")
                continue
            if value is None and "None" in str(f.type):
                continue
            is_int = str(f.type).startswith("int")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    is_int and not isinstance(value, int)):
                kind = "an integer" if is_int else "a number"
                none = f", or leave {f.name} out for none (None in Python)" \
                    if "None" in str(f.type) else ""     # TOML has no null: "none" is a string
                raise ConfigError(f.name, f"must be {kind}", value=value,
                                  fix=f"set {f.name} to {kind}{none}; {f.metadata['doc']}")
            lo_open = f.metadata.get("lo_open")
            if lo is not None and (value < lo or (lo_open and value == lo)):
                bound = f"> {lo}" if lo_open else f">= {lo}"
                raise ConfigError(f.name, f"must be {bound}", value=value,
                                  fix=_range_fix(f.name, lo, hi, lo_open))
            if hi is not None and value > hi:
                raise ConfigError(f.name, f"must be <= {hi}", value=value,
                                  fix=_range_fix(f.name, lo, hi, lo_open))
        if self.min_workers_per_gpu > self.max_workers_per_gpu:
            raise ConfigError("min_workers_per_gpu", "exceeds max_workers_per_gpu",
                              value=self.min_workers_per_gpu,
                              fix=f"use at most max_workers_per_gpu={self.max_workers_per_gpu}")
        if self.memory_watermark_frac > self.memory_critical_frac:
            raise ConfigError("memory_watermark_frac", "exceeds memory_critical_frac",
                              value=self.memory_watermark_frac,
                              fix=f"keep it at or below memory_critical_frac="
                                  f"{self.memory_critical_frac}")
        if self.min_bucket_cap_mb > self.max_bucket_cap_mb:
            raise ConfigError("min_bucket_cap_mb", "exceeds max_bucket_cap_mb",
                              value=self.min_bucket_cap_mb,
                              fix=f"use at most max_bucket_cap_mb={self.max_bucket_cap_mb}")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> GuardConfig:
        """Build from a mapping; unknown keys are rejected with the closest known name."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                import difflib
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else \
                    f"known keys: {', '.join(sorted(known))}"
                raise ConfigError(f"{source}: {key}", "unknown key", fix=hint)
        try:
            return cls(**dict(data))
        except ConfigError as err:   # name where the value came from, as for unknown keys
            raise type(err)(f"{source}: {err.field}", err.problem, value=err.value,
                            fix=err.fix) from None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> GuardConfig:
        """Load from a TOML file: top-level keys, or a ``[raytrain_guard]`` table (then the
        file's other tables, e.g. another tool's, are not read)."""
        try:
            with open(path, "rb") as fh:
                data = _toml.load(fh)
        except FileNotFoundError:
            raise ConfigError("config", "file not found", value=str(path),
                              fix="pass the path of an existing TOML file") from None
        except OSError as exc:      # a directory, no permission, ...
            why = (exc.strerror or type(exc).__name__).lower()
            raise ConfigError("config", f"cannot read it: {why}", value=str(path),
                              fix="pass the path of a TOML file you can read") from None
        except UnicodeDecodeError as exc:
            raise ConfigError("config", f"not UTF-8 (byte {exc.object[exc.start]:#04x} at "
                              f"offset {exc.start})", value=str(path),
                              fix="save the file as UTF-8, as TOML requires") from None
        except _toml.TOMLDecodeError as exc:
            raise ConfigError("config", f"not valid TOML ({exc})", value=str(path),
                              fix="fix the TOML syntax") from None
        return cls.from_dict(_guard_section(data, str(path)), source=str(path))

    def replace(self, **changes: Any) -> GuardConfig:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def budget_frac(self) -> float:
        """Fraction of device memory that tensors and the reserve may use (1 - headroom)."""
        return 1.0 - self.headroom_frac


# -- environment knobs (operational switches read where they act, declared here) ---------------

DISABLE_NVML_ENV = "RAYTRAIN_GUARD_DISABLE_NVML"
"""Set to ``1`` in a node monitor's environment to keep it off NVML (host-only monitoring):
for a driver that misbehaves under NVML polling, or to rehearse a GPU-less node. Read by
``raytrain_guard.cluster.node_probes.default_gpu_probe`` when a monitor starts."""


def nvml_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when :data:`DISABLE_NVML_ENV` is ``1`` in ``environ`` (default: this process)."""
    return (os.environ if environ is None else environ).get(DISABLE_NVML_ENV) == "1"


def _guard_section(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The GuardConfig keys of a TOML document: its ``[raytrain_guard]`` table when it has one
    (top-level keys next to it are refused: they would be dropped), else its top level."""
    def is_our_name(key: str) -> bool:
        return key.replace("-", "_").lower() == "raytrain_guard"

    table = data.get("raytrain_guard")
    for key, value in data.items():
        if isinstance(value, dict) and is_our_name(key) and key != "raytrain_guard":
            raise ConfigError(f"{source}: [{key}]", "unknown table",
                              fix="write the table as [raytrain_guard], with an underscore")
    if not isinstance(table, dict):
        for key, value in data.items():
            if isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}]", "unknown table",
                                  fix="put GuardConfig keys at the top level or in a "
                                      "[raytrain_guard] table")
        return data
    stray = [key for key, value in data.items() if not isinstance(value, dict)]
    if stray:
        raise ConfigError(f"{source}: {stray[0]}", "top-level key next to a [raytrain_guard] "
                          "table, where it is not read",
                          fix=f"move {', '.join(stray)} below the [raytrain_guard] header "
                              f"(keys above it are top-level), or drop the table header")
    return table


def _range_fix(name: str, lo, hi, lo_open) -> str:
    if lo is not None and hi is not None:
        left = "(" if lo_open else "["
        return f"choose {name} in {left}{lo}, {hi}]"
    return f"choose {name} {'>' if lo_open else '>='} {lo}"

