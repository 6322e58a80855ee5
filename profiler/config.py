"""What a Profiler is set up with (ProfilerConfig) and what it is built from (ProfilerDeps, which tests swap).

The profiler reads no environment: its caller (the trainer: dflash/config.py) resolves every setting and hands
them over here.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable


class ConfigFieldError(ValueError):
    """A ProfilerConfig value refused (the message as raised). `field` names it and `why` says what is wrong, with
    each other field it depends on, `refs`, as a `{name}` placeholder: a caller that sets the fields under names
    of its own (a trainer's flags) says the same in its own terms with `why_in(name_of)`."""

    def __init__(self, message: str, field: str, why: str, refs: tuple = ()):
        super().__init__(message)
        self.field, self.why, self.refs = field, why, refs

    def why_in(self, name_of) -> str:
        """`why` with each referenced field named by `name_of(field)`."""
        text = self.why
        for ref in self.refs:
            text = text.replace("{" + ref + "}", name_of(ref))
        return text


def _refused(field: str, why: str) -> ConfigFieldError:
    """The error saying `field` `why` ("capture_steps must be ..., got 0")."""
    return ConfigFieldError(f"{field} {why}", field, why)


def check_interval_s(interval_s) -> float:
    """interval_s as a float; ConfigFieldError (a ValueError) unless it is a positive number of seconds."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
        raise _refused("interval_s", f"must be a positive number of seconds, got {interval_s!r}")
    return float(interval_s)


AUTO_WARMUP_STEPS = 2
"""ProfilerConfig.warmup_steps when left unset: the first step of any loop pays its one-time costs (a compile, lazy
initialisation, cuDNN/Triton autotuning, the allocator's growth), and a second often does too (a recompile for a
new shape, the optimizer's state made at its first update); everything before the first `set_step` is start-up."""


@dataclass(frozen=True)
class ProfilerConfig:
    """The profiler's settings; checked when made (ConfigFieldError, a ValueError, naming the field)."""

    interval_s: float = 60.0
    """Seconds between `interval` records."""
    tick_s: float = 5.0
    """Seconds between `tick` records (cumulative counters and span totals: docs/RUNLOG.md), written besides at
    every interval close; larger than interval_s: only the closes' ticks."""
    detail_steps: int = 3
    """Steps at the start of each interval kept as raw spans (the `spans` record: profiler/detail.py); 0: none."""
    detail_follows: bool = False
    """The detail window keeps the steps the caller marks (`profiler.keep_step()`) instead of choosing its own,
    so a consumer holds the same batches as its producer."""
    hang_timeout_s: float = 0.0
    """> 0: a rank with no progress (no span finished, no step change) this long is stopped with a dump
    (profiler/watchdog.py); 0: no hang watchdog."""
    memory_history: int = 0
    """CUDA allocator history entries kept for an OOM's memory snapshot; 0: none kept."""
    export_timeout_s: float = 5.0
    """Seconds the run's end gives the exporters to drain their queue and close."""
    gpu_drain_timeout_s: float = 2.0
    """Seconds the run's end polls CUDA event pairs still pending before counting them CPU-only."""
    faults: str = ""
    """Fault-injection spec "KIND@SPAN[:step=N][:rank=R];..." (profiler/faults.py); "": no faults."""
    control: bool = True
    """Serve the rank's control endpoint (profiler/control.py), which `dflash-profile snapshot` asks."""
    measure_floors: bool = True
    """Measure the copy floors and the compute peak (profiler/floors.py) at start, against which transfer
    bandwidths and the model FLOP/s (MFU) are read."""
    background: bool = True
    """Run the collector thread; False: the caller drives collection with Profiler.tick() (tests)."""
    poll_s: float = 0.25
    """Seconds between the collector's drains of the span logs."""
    warmup_steps: int | None = None
    """Steps from the segment's first `set_step` that are warm-up: an interval that began before they were done
    (the loop's own start-up before its first `set_step` included) is marked `warmup` and left out of
    steady-state figures (profiler/schema/windows.py). None, the default, is AUTO_WARMUP_STEPS, which fits any loop: its
    start-up (a Trainer's data loader and model placement) and its first steps (a first call's compile, lazy
    initialisation, the allocator's growth) are warm-up, and its steady state starts with the first interval
    that began after them. 0: no warm-up at all."""
    phase_spans: tuple = ()
    """Span names whose time is a phase, not steady work (compilation, evaluation, checkpoints): steady-state
    seconds leave their self time out, and reports show it beside (profiler/schema/windows.py)."""
    span_table: dict | None = None
    """What each span's time is, as plain data written into run_start (docs/RUNLOG.md `span_table`): {span name:
    {"role": the role that enters it, "kind": "work", "wait", "phase" or "collective", "flow": "start" or "end"
    where a trace joins it to its counterpart with an arrow (optional)}}. Reports, traces and live sinks read the
    run's waits, collectives and flows from it (profiler/schema/span_kinds.py). None: no span has a kind of its own."""
    memory_sizes: dict | None = None
    """What each size a loop names with `profiler.memory_sizes()` is, as plain data written into run_start
    (docs/RUNLOG.md `memory_sizes`): {size name: {"role": the role whose steps name it, "scales": {setting (a
    command-line flag): how the size grows with it, 1 linear, 2 quadratic}, "what": one line}}. The memory forecast
    (profiler/report/memory_forecast.py) says "the largest FLAG that fits" per setting from it. None: sizes without
    settings (no forecast)."""
    memory_caps: dict | None = None
    """{setting: another setting whose value it may not pass} written into run_start (docs/RUNLOG.md
    `memory_caps`): the forecast's largest value of the first is at most the run's value of the second. None: none."""
    nvtx: bool = False
    """On CUDA, every span is also an NVTX range for the whole run (Nsight Systems, `ncu --nvtx`)."""
    capture_at_step: int | None = None
    """A Kineto capture (profiler/capture.py) begins at this step; None: only those asked through the endpoint."""
    capture_steps: int = 3
    """Steps each scheduled capture records (at most capture.MAX_STEPS)."""
    capture_every: int = 0
    """> 0: a scheduled capture again every this many steps after capture_at_step; 0: once."""
    numerics: bool = True
    """Take the statistics `profiler.check_numerics()` asks for (profiler/numerics.py) and warn on a drift toward
    overflow (`numerics_drift` events, the interval's `numerics` part); False: `check_numerics()` does nothing."""
    numerics_every: int = 1
    """Sample the statistics at every this many steps (a step whose number is a multiple of it)."""
    numerics_quiet_steps: int = 0
    """Steps from the segment's first sampled one in which the numerics detector neither warns nor builds its
    baselines: the loop's warm-up and its learning-rate warm-up (a resume counts them again)."""

    def __post_init__(self):
        object.__setattr__(self, "interval_s", check_interval_s(self.interval_s))
        if isinstance(self.tick_s, bool) or not isinstance(self.tick_s, (int, float)) or not self.tick_s > 0:
            raise _refused("tick_s", f"must be a positive number of seconds, got {self.tick_s!r}")
        object.__setattr__(self, "tick_s", float(self.tick_s))
        object.__setattr__(self, "phase_spans", tuple(self.phase_spans))
        self._check_capture()
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", AUTO_WARMUP_STEPS)
        if isinstance(self.numerics_every, bool) or not isinstance(self.numerics_every, int) or self.numerics_every < 1:
            raise _refused("numerics_every", f"must be a positive integer, got {self.numerics_every!r}")
        for name in ("detail_steps", "memory_history", "warmup_steps", "numerics_quiet_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _refused(name, f"must be a non-negative integer, got {value!r}")
        if not isinstance(self.detail_follows, bool):
            raise _refused("detail_follows", f"must be a bool, got {self.detail_follows!r}")
        for name in ("hang_timeout_s", "export_timeout_s", "gpu_drain_timeout_s", "poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise _refused(name, f"must be a number of seconds >= 0, got {value!r}")

    def _check_capture(self) -> None:
        from profiler.capture import MAX_STEPS

        at, steps, every = self.capture_at_step, self.capture_steps, self.capture_every
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
            raise _refused("capture_at_step", f"must be None or a non-negative integer, got {at!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise _refused("capture_steps", f"must be an integer from 1 to {MAX_STEPS}, got {steps!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise _refused("capture_every", f"must be a non-negative integer, got {every!r}")
        if every and at is None:
            raise ConfigFieldError("capture_every needs capture_at_step (the first capture)", "capture_every",
                                   "needs {capture_at_step} (the first capture)", refs=("capture_at_step",))
        if every and every <= steps:
            why = f"must be more than capture_steps ({steps}): captures do not overlap"
            raise ConfigFieldError(f"capture_every ({every}) {why}", "capture_every", why)
        if not isinstance(self.nvtx, bool):
            raise _refused("nvtx", f"must be a bool, got {self.nvtx!r}")


@dataclass
class ProfilerDeps:
    """What the profiler is built from; None makes the real one for the device."""

    clock: Callable[[], float] | None = None
    """The interval clock, in seconds; None: time.perf_counter, with interval bounds read once in span time
    (perf_counter_ns), so a span open for a whole interval holds exactly 100% of it."""
    wall_clock: Callable[[], float] = time.time
    """Source of every record's time_unix."""
    memory_sampler: Any = None
    """The NVML sampler (profiler/memory.py: start, stop, interval_summary, latest, headroom_history)."""
    event_pool: Any = None
    """The CUDA event pool spans record on (profiler/cuda_timing.py EventPool, or a fake)."""
    gpu_lag: Any = None
    """Places CUDA spans on the host timeline (profiler/gpu_lag.py: tick, place, take); None: GpuLag on a private
    stream when the profiler made its own CUDA event pool, else none."""
    floors: dict | None = None
    """Copy floors to use instead of measuring them."""
    compute_peaks: dict | None = None
    """The compute peaks MFU reads against ({"datasheet"|"measured": {"flops_per_s", "what"}}, floors.compute_peaks)
    to use instead of measuring them."""
    fault_plan: Any = None
    """A FaultPlan (profiler/faults.py) instead of the one config.faults gives."""
    stack_sampler: Any = None
    """In-run py-spy sampling (profiler/stacks.py); None: none."""
    exit_fn: Callable[[int], None] = os._exit
    """How forensics leave a stuck or crashed rank."""
    capture_session: Callable[[Any], Any] | None = None
    """CaptureRequest -> the session a capture records with (begin, step, stop, ranges); None: torch.profiler
    (profiler/kineto.py's KinetoSession)."""
    step_peaks: Any = None
    """The per-step allocator peaks (profiler/memory_steps.py: sizes, on_step, take); None: StepPeaks on a CUDA
    device, none elsewhere."""
    nvtx_module: Any = None
    """The NVTX module `nvtx=True` pushes ranges with (range_push, range_pop); None: torch.cuda.nvtx, on CUDA only."""
