"""The one validated configuration of the guard (pure: standard library only).

Every threshold the guard uses lives here, with the rule its default comes from. Build it from
Python (``GuardConfig(headroom_frac=0.2)``) or from a TOML file (``GuardConfig.from_toml(path)``);
unknown keys and out-of-range values raise :class:`~raytrain_guard.errors.ConfigError` naming
the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
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
    """Every threshold of raytrain_guard, defaults from the seed rules. Where the measured
    defaults come from: docs/benchmarks.md ("Where the defaults come from")."""

    # -- capacity planning -------------------------------------------------------------------
    headroom_frac: float = _doc(
        0.15, "Fraction of device memory kept free: static memory + activations + reserve must "
        "fit in (1 - headroom_frac) of the card. Seed rule: 15 % headroom.", 0.0, 0.9)
    host_prefetch_frac: float = _doc(
        0.05, "Fraction of host RAM, per GPU, that prefetched batches (num_workers x "
        "prefetch_factor x batch bytes, plus pinned copies) may occupy. Seed rule: 5 % of host "
        "RAM per GPU.", 0.0, 0.5, lo_open=True)
    cuda_context_bytes: int = _doc(
        1 * GiB, "Device memory outside PyTorch's caching allocator (CUDA context, NCCL "
        "buffers): part of the runtime reserve, and added to the allocator's counters by the "
        "CUDA probe. Default 1 GiB: a CUDA 12 context plus NCCL on a Hopper card measures "
        "0.5-1 GiB.", 0)
    fragmentation_frac: float = _doc(
        0.05, "Caching-allocator fragmentation as a fraction of the tensor peak; part of the "
        "runtime reserve. Default 5 %: expandable segments keep reserved within a few percent "
        "of allocated.", 0.0, 1.0)
    min_workers_per_gpu: int = _doc(
        2, "Lower clamp of DataLoader num_workers per GPU. Seed rule: workers clamped to "
        "[2, 8].", 0)
    max_workers_per_gpu: int = _doc(
        8, "Upper clamp of DataLoader num_workers per GPU. Seed rule: workers clamped to "
        "[2, 8].", 1)
    max_prefetch_factor: int = _doc(
        8, "Largest prefetch_factor the planner proposes: deeper queues only hold memory once "
        "the loader keeps up. Default 8, twice the seed's fixed 4.", 1)
    target_num_buckets: int = _doc(
        8, "DDP buckets the bucket-size recommendation aims for, so early buckets' allreduce "
        "overlaps backward. Default 8: below about 4 the last allreduce is exposed; far above, "
        "per-call latency dominates.", 1)
    min_bucket_cap_mb: float = _doc(
        1.0, "Smallest bucket_cap_mb recommended (MiB). Default 1 MiB, the size DDP gives its "
        "own first bucket.", 0.0, lo_open=True)
    max_bucket_cap_mb: float = _doc(
        256.0, "Largest bucket_cap_mb recommended (MiB). Default 256 MiB: beyond it an allreduce "
        "delays its overlap with backward more than it saves in latency.", 0.0, lo_open=True)
    bandwidth_peak_frac: float = _doc(
        0.8, "With a measured allreduce curve, the bucket size is the smallest message "
        "reaching this fraction of the peak bus bandwidth. Default 0.8.", 0.0, 1.0, lo_open=True)
    num_buckets_in_flight: int = _doc(
        2, "DDP bucket buffers alive at once beyond the planned memory (one all-reduced while "
        "the next fills). Default 2, DDP's overlap of one allreduce with backward.", 1)
    list_dataset_min_items: int = _doc(
        1024, "A dataset attribute that is a Python list, tuple or dict of at least this many "
        "items marks the dataset list-backed (copy-on-read in forked workers). Default 1024: "
        "below it the pages touched stay under a few MiB.", 1)

    # -- step gate ---------------------------------------------------------------------------
    memory_watermark_frac: float = _doc(
        0.88, "Memory fraction at which the gate releases cached blocks. Seed rule: watermark "
        "0.88.", 0.0, 1.0, lo_open=True)
    memory_critical_frac: float = _doc(
        0.90, "Memory fraction at which the gate escalates (cluster action, or checkpoint "
        "before an out-of-memory). Seed rule: critical 0.90.", 0.0, 1.0, lo_open=True)
    num_slow_steps: int = _doc(
        3, "Consecutive slow steps that raise a slow-step event. Seed rule: 3 in a row.", 1)
    slow_step_factor: float = _doc(
        1.3, "A step is slow when it takes longer than this multiple of the recent median "
        "step. Default 1.3: a slow link of half a step (steps 1.25-1.57 x the median) is "
        "named within 5 steps in 20 of 20 two-node experiment arms (0 of 20 at 1.5), and "
        "48,000 clean rank-steps at the default device step raise no event (one at 1.25).",
        1.0, lo_open=True)
    slow_step_abs_s: float | None = _doc(
        None, "Optional absolute slow-step threshold in seconds; none (the key left out of a "
        "TOML file, None in Python) uses only the relative rule.", 0.0, lo_open=True)
    step_window: int = _doc(
        50, "Recent steps kept for the median and the attribution. Default 50.", 3)
    cpu_memory_budget_bytes: int | None = _doc(
        None, "On CPU (no CUDA), the process-memory budget the watermark is measured against. "
        "None (the key left out of a TOML file): host RAM / local world size.", 1)
    pacing_enabled: bool = _doc(
        False, "Enable the seed's pacing delay (a sleep before each step under pressure). Off "
        "by default: it trades throughput for memory and is a last resort.")
    pacing_delay_s: float = _doc(
        0.05, "Pacing delay per step when enabled. Default 50 ms.", 0.0)
    memory_hysteresis_frac: float = _doc(
        0.03, "After a cache release the watermark rule re-arms only below "
        "memory_watermark_frac minus this. Default 0.03: one release per crossing, not one "
        "per step.", 0.0, 0.5)
    release_cache_min_interval_s: float = _doc(
        5.0, "Least time between two cache releases of one rank. Default 5 s: empty_cache "
        "synchronizes the device and the next steps re-allocate.", 0.0)
    memory_read_every_steps: int = _doc(
        4, "StepGuard's fast path: a host-memory reading more than 0.05 below the watermark "
        "is reused and read again every this many steps (up to 4x as many the farther below); "
        "nearer, every step. Default 4: the /proc read was the guard's largest cost. 1: every "
        "step.", 1)
    gate_batch_steps: int = _doc(
        20, "StepGuard's fast path: steps that cannot decide anything reach the gate together "
        "at least every this many steps (at most step_window // 2 - 5). Default 20: they share "
        "the gate's fixed cost. Decisions come at the same steps whatever the value.", 1)
    memory_trend_steps: int = _doc(
        5, "Recent memory readings the gate (a rank's, per step) and the coordinator (a "
        "node's host memory, per sample) fit a line through to predict the memory fraction "
        "ahead. Default 5: enough to ignore one noisy reading.", 2)
    memory_predict_steps: int = _doc(
        3, "Above the watermark, the gate checkpoints and stops when the trend reaches "
        "memory_critical_frac within this many steps. Default 3; 0: the reading alone "
        "escalates.", 0)
    slow_step_warmup_steps: int = _doc(
        2, "First steps the slow-step rules ignore (kept out of the median). Default 2: DDP "
        "rebuilds its buckets, lazy initialisation and compilation happen then.", 0)
    slow_step_settle_steps: int = _doc(
        3, "Steps after a checkpoint or a restore that the slow-step rules ignore, as the "
        "first steps of a run. Default 3: the three steps after a checkpoint measured twice "
        "their compute.", 0)
    slow_step_peer_work_frac: float = _doc(
        0.5, "A step slow in communication while another rank of this node did more work by at "
        "least this fraction of the step's excess waited for that rank: it does not count "
        "toward a run of slow steps (that rank's gate judges it). 0: off. Default 0.5.", 0.0)
    pause_gap_steps: float = _doc(
        3.0, "A gap between two steps longer than this many median steps is a pause "
        "(checkpoint, evaluation): the steps after it settle as after a checkpoint. Default "
        "3: a loop that syncs with the GPU between steps waits about one step.", 0.0,
        lo_open=True)
    straggler_frac: float = _doc(
        0.10, "A rank is a straggler when its compute (or data wait) exceeds the other ranks' "
        "median by more than this fraction of their median step, and waiting when its "
        "communication wait exceeds the least by as much. Default 10 %.", 0.0, lo_open=True)
    straggler_steps: int = _doc(
        20, "The coordinator names a straggler slower than the reference rank (straggler_frac, "
        "slow_step_floor_s, slow_step_mad_k) over this many consecutive steps, all but one in "
        "ten. Default 20, two report batches: clean runs stayed under 11.", 1)

    # -- guarded DataLoader ------------------------------------------------------------------
    loader_probe_samples: int = _doc(
        8, "Samples the guarded DataLoader reads and collates before starting workers, to "
        "measure batch bytes and check that samples agree in type and shape. Default 8.", 1)
    worker_memory_interval_s: float = _doc(
        5.0, "Sampling interval of a process's private memory (USS): the guarded DataLoader's "
        "workers, and the node monitor's train workers and their loader workers. Default 5 s: "
        "reading smaps (some 7 ms for a process holding torch) stays far below 1 % of a core.",
        0.0, lo_open=True)
    worker_memory_growth_samples: int = _doc(
        5, "Consecutive non-decreasing worker-memory samples that count as steady growth "
        "(copy-on-read). Default 5: 20 s of climbing.", 2)
    worker_memory_growth_bytes: int = _doc(
        64 * 1024**2, "Least growth of the workers' private memory over those samples that "
        "warns of copy-on-read. Default 64 MiB, above allocator warm-up.", 1)
    ray_data_raise_wait_frac: float = _doc(
        0.10, "An epoch of Ray Data batches (raytrain_guard.train.iter_torch_batches) that "
        "waited for data more than this fraction of its time doubles prefetch_batches for the "
        "next epoch, within max_prefetch_factor and the host budget (host_prefetch_frac). "
        "Default 10 %, straggler_frac's: a data wait of a tenth of the step is what names a "
        "rank a data straggler. 1: never raised.", 0.0, 1.0, lo_open=True)

    # -- cluster -----------------------------------------------------------------------------
    monitor_interval_s: float = _doc(
        1.0, "Node monitor sampling interval. Default 1 s.", 0.0, lo_open=True)
    report_every_steps: int = _doc(
        10, "Steps per batch of statistics a rank sends to the coordinator. Default 10.", 1)
    lockstep_every_steps: int = _doc(
        10, "Every K steps the ranks agree on pending decisions through one tiny collective; "
        "a decision applies at the next multiple of K. Default 10.", 1)
    checkpoint_every_steps: int = _doc(
        200, "Steps between checkpoints of the shared train loop. Default 200.", 1)
    decision_interval_s: float = _doc(
        1.0, "The coordinator's policy runs at most this often. Default 1 s, the monitors' "
        "interval.", 0.0)
    decision_cooldown_steps: int = _doc(
        20, "Steps after a cluster action's apply step before it may be decided again or "
        "escalated. Default 20, two report batches.", 1)
    host_memory_watermark_frac: float = _doc(
        0.90, "Host memory used fraction at which the policy lowers the node's prefetch depth. "
        "Default 0.90: below Ray's memory monitor (0.95).", 0.0, 1.0, lo_open=True)
    host_memory_stop_frac: float = _doc(
        0.93, "A node's host memory used fraction at which the policy checkpoints and stops "
        "every rank (sooner past the watermark where its last samples reach it before a stop "
        "decided next round could land). Default 0.93: a stop lands some 2-3 s after the "
        "sample, before Ray's memory monitor kills a worker at 0.95.", 0.0, 1.0, lo_open=True)
    coordinator_retry_s: float = _doc(
        5.0, "Least time between two lookups of an unreachable coordinator by name. Default "
        "5 s: Ray restarts a killed actor within seconds.", 0.0)
    node_sample_max_age_intervals: int = _doc(
        10, "A node sample older than this many monitor_interval_s no longer counts in the "
        "policy. Default 10 missed samples.", 1)
    straggler_min_steps: int = _doc(
        3, "Steps a rank's window must hold before the coordinator scores it as a straggler. "
        "Seed rule: 3 (as num_slow_steps).", 1)
    oom_stop_frac: float = _doc(
        0.98, "Device memory fraction, projected to the step after the next apply step, at "
        "which the policy checkpoints and stops. Default 0.98: one allocation from the end.",
        0.0, 1.0, lo_open=True)
    hang_floor_s: float = _doc(
        10.0, "Least time a step may run before the hang watchdog names its rank and ends the "
        "attempt. Default 10 s, far under Ray Train's 30 min collective timeout.", 0.0,
        lo_open=True)
    hang_step_multiple: float = _doc(
        20.0, "A step longer than this multiple of the rank's median step (and hang_floor_s) "
        "is a hang. Default 20.", 1.0)

    # -- noise and effects: decisions that know their effect -----------------------------------
    slow_step_floor_s: float = _doc(
        0.002, "A step is slow, and a rank a straggler, only when it exceeds the median (the "
        "reference) by at least this many seconds. Default 2 ms: above clean CPU jitter, "
        "below the smallest slowdown to name.", 0.0)
    slow_step_mad_k: float = _doc(
        3.5, "A step is slow only when it exceeds the median by this many robust standard "
        "deviations (1.4826 x MAD). Default 3.5: Iglewicz and Hoaglin's modified z-score "
        "cut-off.", 0.0)
    slow_component_growth_steps: float = _doc(
        1.0, "A step is also slow when the rank's data wait or compute grew by this many "
        "median steps (and the floor and spread): a straggler's compute grows while its wait "
        "shrinks. 0: off. Default 1.0.", 0.0)
    slow_step_adaptive_persistence: bool = _doc(
        True, "A run of slow steps must also outlast every streak that ended by itself in the "
        "window (at most 3 x num_slow_steps), so streaky noise is not named. Default on; on a "
        "clean box it asks num_slow_steps.")
    cache_release_min_frac: float = _doc(
        0.05, "A cache release is decided only when the allocator holds at least this "
        "fraction of the card cached but unallocated (never on CPU). Default 5 %, the "
        "planner's fragmentation_frac.", 0.0, 1.0)
    effect_min_share: float = _doc(
        0.5, "An action whose measured effect is below this share of its prediction is not "
        "repeated for that cause; the policy escalates. Default 0.5.", 0.0, 1.0)

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> GuardConfig:
        """Build from a mapping; unknown keys are rejected with the closest known name."""
        _check_known(data, {f.name for f in fields(cls)}, source)
        try:
            return cls(**dict(data))
        except ConfigError as err:   # name where the value came from, as for unknown keys
            raise type(err)(f"{source}: {err.field}", err.problem, value=err.value,
                            fix=err.fix) from None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> GuardConfig:
        """Load from a TOML file: top-level keys, or a ``[raytrain_guard]`` table (then the
        file's other tables, e.g. another tool's, are not read)."""
        return cls.from_dict(_guard_section(_read_toml(path), str(path)), source=str(path))

    def replace(self, **changes: Any) -> GuardConfig:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def budget_frac(self) -> float:
        """Fraction of device memory that tensors and the reserve may use (1 - headroom)."""
        return 1.0 - self.headroom_frac


def _validate(config: GuardConfig) -> None:
    """Every field in its type and range (the metadata of :func:`_doc`); pairs in order."""
    for f in fields(config):
        value = getattr(config, f.name)
        lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
        if lo is None and hi is None:
            if f.type == "bool" and not isinstance(value, bool):
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
    for low, high in (("min_workers_per_gpu", "max_workers_per_gpu"),
                      ("memory_watermark_frac", "memory_critical_frac"),
                      ("host_memory_watermark_frac", "host_memory_stop_frac"),
                      ("min_bucket_cap_mb", "max_bucket_cap_mb")):
        if getattr(config, low) > getattr(config, high):
            raise ConfigError(low, f"exceeds {high}", value=getattr(config, low),
                              fix=f"use at most {high}={getattr(config, high)}")


def _check_known(data: Mapping[str, Any], known: set[str], source: str) -> None:
    """A ConfigError for the first key of ``data`` not in ``known``, with the closest name."""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else \
                f"known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"{source}: {key}", "unknown key", fix=hint)


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML file's document; a file that cannot be read is a ConfigError saying why."""
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
    return data


# -- environment knobs (operational switches read where they act, declared here) ---------------

DISABLE_NVML_ENV = "RAYTRAIN_GUARD_DISABLE_NVML"
"""Set to ``1`` in a node monitor's environment to keep it off NVML (host-only monitoring):
for a driver that misbehaves under NVML polling, or to rehearse a GPU-less node. Read by
``raytrain_guard.cluster.monitor.probes.default_gpu_probe`` when a monitor starts."""


def nvml_disabled() -> bool:
    """True when :data:`DISABLE_NVML_ENV` is ``1`` in this process's environment."""
    return os.environ.get(DISABLE_NVML_ENV) == "1"


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
        return f"choose {name} in {'(' if lo_open else '['}{lo}, {hi}]"
    return f"choose {name} {'>' if lo_open else '>='} {lo}"

