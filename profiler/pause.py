"""Profiling paused on a live run, for an in-run on/off comparison (`dflash-profile overhead`).

Whole-run A/B pairs on a shared host spread by +-10% or more (a run's busy threads stay on whichever
vCPUs they landed on: bench/RESULTS.md), so they cannot resolve a 1% cost there. Alternating profiled
and unprofiled phases inside one run keeps the process, its placement and its caches, and pairs
phases seconds apart.

While paused, the training threads run the code `--no-profile` runs: `profiler.span()` returns the
shared no-op spans, count/gauge/metric/tag do nothing, check_finite/check_flags launch nothing, faults
do not fire. Kept: `set_step` records the step and its time (read by the overhead command through the
endpoint's `progress`, and by the hang watchdog, which keeps watching), events are written, forensics
sources and the first non-finite finding read so far stay, and checks issued before the pause are still
read back (sent at once: a pause wakes the collector, as a resume does). The background threads hold still: the
collector does not drain, the interval clock stops (an interval holds `interval_s` of profiled time, so
interval closes and the exporters' work behind them come at their natural rate in profiled time, and
never pile up at a resume), the NVML and stack samplers skip their samples. Left running, and idle: the
exporter thread (no records come), the control endpoint (it serves the commands), the watchdog.

A pause may stop one part only (`part`), to find which part of the profiler costs a run:
- `inline`: the training threads' instrumentation (the no-op path above); the background threads run on,
  with little to do.
- `background`: the collector, the interval clock and the samplers hold still, while the training
  threads' spans, counters and checks keep being logged (the collector still reads the checks' flags
  back, as in every pause: forensics never pause); at the resume the collector is woken at once,
  so the backlog is drained right away (inside the overhead command's settle time, not in the next
  measured phase). A backlog grows in memory (records, CUDA events), so this lease is
  shorter (MAX_BACKGROUND_LEASE_S).
- `gpu`: only the spans' GPU timing: every span is a CPU span (no CUDA event) while everything else
  profiles on, so the on/off difference is what the run's CUDA events cost it (at the run's
  `--profile-gpu-steps-per-s`; 0 times every step).
`all` (the default) is inline and background; `none` is nothing (an A/A calibration of the overhead command
itself).

A pause is a lease: it ends by itself `lease_s` after the last `pause` command, so a client that dies
cannot leave a run unprofiled; one owner at a time. Each interval record says how long it was paused
(`paused_seconds`, `pauses`, and `paused_parts` when a pause stopped one part only: docs/RUNLOG.md).
"""
from __future__ import annotations

import logging
import threading
import time

from profiler import api

logger = logging.getLogger("profiler")

MAX_LEASE_S = 600.0
MAX_BACKGROUND_LEASE_S = 60.0
MAX_OWNER_CHARS = 200
PARTS = {"all": (True, True, False), "inline": (True, False, False), "background": (False, True, False),
         "gpu": (False, False, True), "none": (False, False, False)}
"""What a pause of each part stops: (the training threads' instrumentation, the background threads, the spans'
GPU timing). `none` stops nothing: the off phases profile as the on phases do, an A/A run that measures the
measurement's own bias (the commands, the phase order, the settle), which every on/off figure carries too."""


def max_lease_s(part: str) -> float:
    """The longest lease a pause of `part` may take (a background pause keeps a backlog in memory)."""
    inline, background, _ = PARTS[part]
    return MAX_BACKGROUND_LEASE_S if background and not inline else MAX_LEASE_S


class _PausedNonfinite:
    """The monitor as the API sees it while paused: no new checks; findings so far stay visible."""

    def __init__(self, monitor):
        self._monitor = monitor

    @property
    def first(self):
        return self._monitor.first

    def check_flags(self, *args, **kwargs) -> None:
        pass

    def settle(self, timeout_s: float):
        return self._monitor.settle(timeout_s)


class PausedView:
    """What `profiler.active()` is while paused: set_step and events reach the profiler, the checks and
    faults do nothing, and any other attribute is the profiler's own."""

    def __init__(self, profiler):
        self.profiler = profiler
        self.nonfinite = _PausedNonfinite(profiler.nonfinite)

    def set_step(self, step: int) -> None:
        self.profiler.note_step(step)   # the step and its time; no detail-window mark
        self.profiler.gpu_sampler.count_step()   # the interval's step rate counts paused steps too

    def corrupt(self, span_name: str, tensor, step=None):
        return tensor

    def check_finite(self, span_name: str, tensors: dict, step=None, **fields) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self.profiler, name)


def _bad_request(owner, lease_s, part) -> str | None:
    if not isinstance(owner, str) or not owner or len(owner) > MAX_OWNER_CHARS:
        return f"pause needs an 'owner' string of 1 to {MAX_OWNER_CHARS} characters, got {owner!r:.80}"
    if not isinstance(part, str) or part not in PARTS:
        return f"pause needs 'part' one of {', '.join(PARTS)}, got {part!r:.80}"
    cap = max_lease_s(part)
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s <= cap:
        return f"pause of part {part!r} needs 'lease_s' in (0, {cap:g}] seconds, got {lease_s!r:.80}"
    return None


class PauseControl:
    """Pause and resume one profiler (commands `pause` and `resume` of its control endpoint).

    `samplers` are objects with a `paused` attribute their threads read before each sample;
    `interval_clock` has hold(), release() and poke() (profiler/intervals.py IntervalTimer): stopped while
    the background is paused, and woken at its resume. `gpu_sampler` (profiler/cuda_timing.py GpuSampler) is
    held while the spans' GPU timing is paused."""

    def __init__(self, profiler, recorder, samplers=(), interval_clock=None, clock=time.monotonic,
                 gpu_sampler=None):
        self._profiler, self._recorder, self._gpu_sampler = profiler, recorder, gpu_sampler
        self._samplers, self._interval_clock, self._clock = list(samplers), interval_clock, clock
        self._lock = threading.Lock()
        self._view: PausedView | None = None
        self.owner: str | None = None
        self.part: str | None = None
        self.lease_end_s = 0.0
        self._since_ns = 0
        self._paused_ns = 0      # paused time in the current interval, up to _since_ns
        self._pauses = 0         # pauses begun in the current interval
        self._parts: set = set()   # parts paused in the current interval

    @property
    def active(self) -> bool:
        return self.owner is not None

    @property
    def background_held(self) -> bool:
        """The collector holds still (a pause of `all` or `background`): it only watches the lease."""
        part = self.part
        return part is not None and PARTS[part][1]

    def pause(self, owner, lease_s, part="all") -> dict:
        """Pause `part` (or renew the lease of the caller's pause); an error while another owner holds it,
        or when the caller's pause is of another part."""
        why = _bad_request(owner, lease_s, part)
        if why is not None:
            return {"ok": False, "error": why}
        with self._lock:
            if self.owner is not None and self.owner != owner:
                left_s = self.lease_end_s - self._clock()
                return {"ok": False, "error": f"paused by {self.owner} for {left_s:.1f} s more"}
            if self.owner is not None and self.part != part:
                return {"ok": False, "error": f"paused ({self.part}) by {owner} already: resume before pausing {part}"}
            self.lease_end_s = self._clock() + float(lease_s)
            if self.owner is None:
                self._pause_locked(owner, part)
        return {"ok": True, "paused": True, "part": part, "lease_s": float(lease_s)}

    def _pause_locked(self, owner: str, part: str) -> None:
        inline, background, gpu = PARTS[part]
        self.owner, self.part, self._since_ns = owner, part, time.perf_counter_ns()
        self._pauses += 1
        self._parts.add(part)
        if inline:
            self._view = PausedView(self._profiler)
            api.suspend(self._profiler, self._view)
        if background:
            self._set_samplers(True)
            if self._interval_clock is not None:
                self._interval_clock.hold()
        if gpu and self._gpu_sampler is not None:
            self._gpu_sampler.hold(True)
        if self._interval_clock is not None:
            # The checks queued while profiling are sent at the collector's next poll: make it now, inside the
            # overhead command's settle, not ~0.25 s later in the measured off phase (a bias toward "on").
            self._interval_clock.poke()

    def resume(self, owner=None) -> dict:
        """Resume; `owner` None resumes whoever paused (the run's end)."""
        with self._lock:
            if self.owner is None:
                return {"ok": True, "paused": False}
            if owner is not None and owner != self.owner:
                return {"ok": False, "error": f"paused by {self.owner}, not by {owner}"}
            self._resume_locked()
        return {"ok": True, "paused": False}

    def expire(self) -> None:
        """Resume when the lease ran out (the collector calls this at every poll); checked and done under
        the lock, so a renewal that comes first keeps the pause."""
        with self._lock:
            if self.owner is None or self._clock() < self.lease_end_s:
                return
            owner = self.owner
            self._resume_locked()
        logger.warning("profiler: the pause by %s ran out of its lease; profiling again", owner)

    def _resume_locked(self) -> None:
        inline, background, gpu = PARTS[self.part]
        if gpu and self._gpu_sampler is not None:
            self._gpu_sampler.hold(False)
        if background and self._interval_clock is not None:
            self._interval_clock.release()
        if inline:
            api.unsuspend(self._profiler, self._view, self._recorder)
        if background:
            self._set_samplers(False)
        self._paused_ns += time.perf_counter_ns() - self._since_ns
        self.owner, self.part, self._view = None, None, None
        if background and self._interval_clock is not None:
            self._interval_clock.poke()   # drain the backlog now, not in the next measured phase

    def take_interval(self, now_ns: int) -> dict:
        """{"paused_seconds", "pauses"} of the interval closing at now_ns ({} when it never paused), with
        "paused_parts" when a pause in it stopped one part only; the next interval starts from zero."""
        with self._lock:
            paused_ns = self._paused_ns
            if self.owner is not None:
                paused_ns += now_ns - self._since_ns
                self._since_ns = now_ns
            pauses, parts = self._pauses, sorted(self._parts)
            self._paused_ns, self._pauses = 0, 0
            self._parts = {self.part} if self.part is not None else set()
        if not pauses and not paused_ns:
            return {}
        out = {"paused_seconds": paused_ns / 1e9, "pauses": pauses}
        if parts and parts != ["all"]:
            out["paused_parts"] = parts
        return out

    def _set_samplers(self, paused: bool) -> None:
        for sampler in self._samplers:
            sampler.paused = paused
