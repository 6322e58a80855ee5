"""What a Profiler is set up with (ProfilerConfig) and what it is built from (ProfilerDeps, which tests swap).

The profiler reads no environment: its caller (the trainer: dflash/config.py) resolves every setting and hands
them over here.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable


def check_interval_s(interval_s) -> float:
    """interval_s as a float; ValueError unless it is a positive number of seconds."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    return float(interval_s)


@dataclass(frozen=True)
class ProfilerConfig:
    """The profiler's settings; checked when made (ValueError naming the field)."""

    interval_s: float = 60.0            # seconds between `interval` records
    detail_steps: int = 3               # steps per interval kept as raw spans (profiler/detail.py); 0: none
    detail_follows: bool = False        # keep the steps the caller marks (profiler.keep_step), as its producer's
    hang_timeout_s: float = 0.0         # > 0: no progress this long stops the rank with a dump (watchdog.py)
    memory_history: int = 0             # CUDA allocator history entries kept for an OOM's snapshot; 0: none
    export_timeout_s: float = 5.0       # seconds the run's end gives the exporters to drain and close
    gpu_drain_timeout_s: float = 2.0    # seconds the run's end polls pending CUDA pairs before CPU-only
    faults: str = ""                    # fault spec "KIND@SPAN[:step=N][:rank=R];..." (profiler/faults.py)
    control: bool = True                # serve the control endpoint `dflash-profile snapshot` asks
    measure_floors: bool = True         # measure the copy floors (floors.py) transfer bandwidths are read against
    background: bool = True             # run the collector thread; False: the caller drives Profiler.tick()
    poll_s: float = 0.25                # seconds between the collector's drains of the span logs
    run_id: str | None = None           # the run's id in run_start and the exporters; None: the run dir's name
    warmup_steps: int = 0               # steps from the first set_step that are warm-up: intervals begun before
                                        # they were done are marked `warmup`, out of steady-state figures
    phase_spans: tuple = ()             # spans whose self time is a phase (compile, evaluation, checkpoints),
                                        # left out of steady-state seconds and reported beside them

    def __post_init__(self):
        object.__setattr__(self, "interval_s", check_interval_s(self.interval_s))
        object.__setattr__(self, "phase_spans", tuple(self.phase_spans))
        for name in ("detail_steps", "memory_history", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.detail_follows, bool):
            raise ValueError(f"detail_follows must be a bool, got {self.detail_follows!r}")
        for name in ("hang_timeout_s", "export_timeout_s", "gpu_drain_timeout_s", "poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")


@dataclass
class ProfilerDeps:
    """What the profiler is built from; None makes the real one for the device."""

    # The interval clock in seconds; None: time.perf_counter, with interval bounds read once in span time
    # (perf_counter_ns), so a span open for a whole interval holds exactly 100% of it.
    clock: Callable[[], float] | None = None
    wall_clock: Callable[[], float] = time.time   # every record's time_unix
    memory_sampler: Any = None    # NVML sampler (profiler/memory.py: start, stop, interval_summary, latest, ...)
    nvml: Any = None              # the pynvml module the default sampler uses; None: imported when needed
    event_pool: Any = None        # CUDA event pool spans record on (cuda_timing.EventPool, or a fake)
    floors: dict | None = None    # copy floors to use instead of measuring them
    fault_plan: Any = None        # a FaultPlan (profiler/faults.py) instead of config.faults'
    stack_sampler: Any = None     # in-run py-spy sampling (profiler/stacks.py); None: none
    exit_fn: Callable[[int], None] = os._exit   # how forensics leave a stuck or crashed rank
