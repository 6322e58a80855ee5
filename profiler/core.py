"""The Profiler: the composition root that builds spans, CUDA timing, the collector, memory, floors, control and the
run log from one ProfilerConfig and the dependencies it is given (profiler/config.py), and writes the records."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path

from profiler import allocator_snapshot, api
from profiler.capture import Captures, CaptureSchedule, CaptureSpans, NullCaptures
from profiler.collector import Collector
from profiler.config import ProfilerConfig, ProfilerDeps
from profiler.control import ControlServer, NullControlServer
from profiler.detail import DetailWindow, NullDetailWindow, StepMarks
from profiler.export import ExportHub
from profiler.faults import FaultPlan
from profiler.floors import compute_peaks, floor_for_span, measure_floors
from profiler.forensics import Forensics, install_autotune_spans, make_memory_history
from profiler.gpu_lag import NullGpuLag
from profiler.intervals import IntervalAggregator
from profiler.memory import make_memory_sampler, memory_state
from profiler.memory_steps import NullStepPeaks, make_step_peaks
from profiler.nonfinite import NonfiniteMonitor, make_readback
from profiler.numerics import NumericsDetector, drift_line
from profiler.schema.records import SCHEMA_VERSION
from profiler.runlog import RunLog, host_fields
from profiler.spans import SpanRecorder, check_name
from profiler.stacks import NullStackSampler
from profiler.stats import HISTOGRAM_BUCKETS_SECONDS
from profiler.threadcpu import threads_section
from profiler.watchdog import NullWatchdog, Watchdog

logger = logging.getLogger("profiler")


class Profiler:
    """Per-process profiler; `with Profiler(run_dir, ...):` makes it the active one, so the profiler API records
    into RUN_DIR/profile/rank{R}.jsonl (docs/RUNLOG.md). `run_config` goes into run_start as "config", `run_id`
    as "run_id" (default: the run directory's name); `exporters` (profiler/export.py) get every record on the
    exporter thread: a list of them, or a function of this Profiler that makes the list when the run starts
    (`exporters.build("console,prometheus,trace")`, so the sinks see its run directory, rank and role).
    docs/API.md is the reference."""

    def __init__(self, run_dir, rank: int = 0, world_size: int = 1, role: str = "main", device=None,
                 run_config=None, config: ProfilerConfig | None = None, deps: ProfilerDeps | None = None,
                 exporters=(), run_id: str | None = None):
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Profiler: rank must be a non-negative int, got {rank!r}")
        if not isinstance(role, str) or not role:
            raise ValueError(f"Profiler: role must be a non-empty string, got {role!r}")
        if not isinstance(config or ProfilerConfig(), ProfilerConfig):
            raise TypeError(f"Profiler: config must be a ProfilerConfig (the run's own goes in run_config), "
                            f"got {type(config).__name__}")
        self.run_dir, self.rank, self.world_size, self.role = Path(run_dir), rank, world_size, role
        self.run_id = run_id or self.run_dir.resolve().name
        self.cfg, self.deps = config or ProfilerConfig(), deps or ProfilerDeps()
        self.interval_s, self.run_config, self.device = self.cfg.interval_s, run_config, device
        self.is_cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self.clock, self.wall_clock = self.deps.clock or time.perf_counter, self.deps.wall_clock
        self.log_path = self.run_dir / "profile" / f"rank{rank}.jsonl"
        self._exporters = exporters
        self.hub = ExportHub(())   # the run's own, made at start
        self.stack_sampler = self.deps.stack_sampler or NullStackSampler()
        self.marks = StepMarks()
        self.captures = NullCaptures()   # Captures once started (profiler/capture.py)
        self.step_peaks = NullStepPeaks()   # StepPeaks once started on a CUDA device (profiler/memory_steps.py)
        self.step, self._first_step, self._step_changed = 0, None, False
        self._interval_start_step = None   # the step when the current interval began (None: before set_step)
        self._drift_said: set = set()      # spans whose numerics drift the console was told of
        self._started = False

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self):
        if api.active() is not None:
            raise RuntimeError(f"a profiler is already active in this process (rank {api.active().rank}); "
                               f"close it before starting another")
        self._cleanups = []
        try:
            self._start()
        except BaseException:
            self._run_cleanups()
            raise
        return self

    def _start(self) -> None:
        cfg, deps = self.cfg, self.deps
        self.runlog = self._started_with(RunLog(self.log_path), "close")
        self.floors = deps.floors if deps.floors is not None else (
            measure_floors(self.device) if cfg.measure_floors else {})
        self.compute_peaks = deps.compute_peaks if deps.compute_peaks is not None else (
            compute_peaks(self.device, host_fields(self.device, self.is_cuda)["device_name"])
            if cfg.measure_floors else {})
        self.fault_plan = deps.fault_plan or FaultPlan.from_spec(cfg.faults, self.rank)
        self.event_pool = deps.event_pool
        if self.event_pool is None and self.is_cuda:
            from profiler.cuda_timing import EventPool
            self.event_pool = EventPool(device_index=self.device.index)   # None: the current device
        self.recorder = SpanRecorder(event_pool=self.event_pool, fault_plan=self.fault_plan,
                                     step_fn=lambda: self.step, ranges=self._nvtx_ranges())
        self.numerics = NumericsDetector(self._on_numerics_drift, cfg.numerics_quiet_steps, cfg.numerics_every)
        self.nonfinite = NonfiniteMonitor(self.rank, self._on_nonfinite,
                                          readback=make_readback(self.is_cuda, self.device, self.event_pool),
                                          on_stats=self.numerics.observe if cfg.numerics else None)
        self.anchor_perf_ns, self.anchor_unix_ns = time.perf_counter_ns(), int(self.wall_clock() * 1e9)
        made = self._exporters(self) if callable(self._exporters) else self._exporters
        self.hub = ExportHub(made)
        self.hub.start()
        self._cleanups.append(lambda: self.hub.close(cfg.export_timeout_s))
        self.sampler = self._started_with(deps.memory_sampler or make_memory_sampler(self.device))
        self.step_peaks = deps.step_peaks or make_step_peaks(self.device, self.is_cuda)
        self.collector, self.captures = self._make_collector()
        self._write(self._run_start_record())
        self._start_forensics()
        api.activate(self, self.recorder)
        self._cleanups.append(lambda: api.deactivate(self))
        self.control = self._started_with(
            ControlServer(self.run_dir, self.rank, self.role, self.state,
                          record_fn=lambda fields: self.write_record("snapshot", **fields),
                          commands={"capture": lambda request: self.captures.request(request.get("fields") or {}),
                                    "memory": self._memory_command()})
            if cfg.control else NullControlServer(), "close")
        self._started_with(self.stack_sampler)
        if cfg.background:
            self._started_with(self.collector)
        self._started = True

    def _started_with(self, part, undo: str = "stop"):
        """Start `part` (where it has a start()) and have the run's end call its `undo`; returns it."""
        start = getattr(part, "start", None)
        if start is not None:
            start()
        self._cleanups.append(getattr(part, undo))
        return part

    def _make_collector(self) -> tuple[Collector, Captures]:
        """The collector, its aggregator fed to the detail window through the captures' spans (CaptureSpans, given
        the open spans and the aggregator's pending CUDA pairs), and the captures (profiler/capture.py)."""
        recorder, pending = self.recorder, []   # pending: the aggregator's CUDA pairs, which CaptureSpans reads
        detail = (DetailWindow(self.cfg.detail_steps, self.marks, self.to_unix_ns, recorder.native_ids,
                               follows=self.cfg.detail_follows)
                  if self.cfg.detail_steps > 0 else NullDetailWindow())
        capture_spans = CaptureSpans(detail, functools.partial(self.event, "capture"), self.to_unix_ns,
                                     recorder.native_ids, functools.partial(recorder.open_spans, ids=True), pending)
        aggregator = IntervalAggregator(self.floors, floor_for_span, self.is_cuda, self.event_pool, capture_spans,
                                        gpu_lag=self._gpu_lag(), pending=pending)
        sections = (lambda d: {"memory": memory_state(self.sampler, self.device, interval=True,
                                                      step_peaks=self.step_peaks)},
                    threads_section(recorder.native_ids), lambda d: {"exporters": self.hub.stats()}, self.numerics.section,
                    self._stack_samples, self._steps_section)
        collector = Collector(recorder, aggregator, self.nonfinite, interval_s=self.interval_s,
                              clock=self.clock, perf_clock=self.deps.clock in (None, time.perf_counter),
                              poll_s=self.cfg.poll_s, header=self._header, write=self._write,
                              step_fn=lambda: self.step, sections=sections, tick_s=self.cfg.tick_s,
                              tick_fields=self._tick_fields)
        return collector, self._make_captures(capture_spans)

    def _gpu_lag(self):
        """The injected GpuLag; else one on a private stream when the profiler made its own CUDA event pool
        (profiler/gpu_lag.py); else none (a test's fake pool, the CPU)."""
        if self.deps.gpu_lag is not None:
            return self.deps.gpu_lag
        if self.is_cuda and self.deps.event_pool is None:
            from profiler.gpu_lag import make_gpu_lag
            return make_gpu_lag(self.event_pool.device_index)
        return NullGpuLag()

    def _make_captures(self, spans: CaptureSpans) -> Captures:
        """Kineto captures at step boundaries (profiler/capture.py), asked through the endpoint or scheduled."""
        cfg = self.cfg
        schedule = (CaptureSchedule(cfg.capture_at_step, cfg.capture_steps, cfg.capture_every)
                    if cfg.capture_at_step is not None else None)
        return Captures(self.run_dir, self.rank, self.recorder, spans, self.deps.capture_session or self._kineto,
                        lambda: self.step, schedule)

    def _kineto(self, request):
        from profiler.kineto import KinetoSession
        meta = {"run_id": self.run_dir.resolve().name, "rank": self.rank, "role": self.role, "step": request.at_step,
                "steps": request.steps, "clock": {"perf_counter_ns": self.anchor_perf_ns,
                                                   "unix_ns": self.anchor_unix_ns}}
        return KinetoSession(request, self.is_cuda, self.rank, self.world_size, meta)

    def _nvtx_ranges(self):
        """NVTX ranges around every span for the run (`nvtx=True`): on CUDA, or with a stand-in module."""
        if not self.cfg.nvtx or not (self.is_cuda or self.deps.nvtx_module is not None):
            return None
        from profiler.kineto import nvtx_ranges
        return nvtx_ranges(self.deps.nvtx_module)

    def _memory_command(self):
        """The endpoint's `memory` command: an allocator snapshot (profiler/allocator_snapshot.py)."""
        if not self.is_cuda:
            return allocator_snapshot.no_allocator(self.rank, self.role)

        def open_spans() -> list:
            with contextlib.suppress(Exception):
                self.collector.poll()   # replay the threads' logs so the open stacks are current
            return self.recorder.open_spans()

        def reply(_request) -> dict:
            return allocator_snapshot.save(self.run_dir, self.rank, self.device, self.cfg.memory_history > 0,
                                           open_spans, self.event, self.wall_clock)
        return reply

    def _steps_section(self, duration_s: float) -> dict:
        """The interval's `step_rate` (steps the loop's `set_step` advanced in it, and per second; absent before
        the first `set_step`), and {"warmup": True} for an interval that began before the first `warmup_steps`
        steps were done."""
        began_at = self._interval_start_step
        self._interval_start_step = self.step if self._first_step is not None else None
        out = {}
        if self._first_step is not None:
            steps = self.step - (self._first_step if began_at is None else began_at)
            out["step_rate"] = {"steps": steps if steps >= 0 else None,   # None: the loop set a smaller step
                                "per_second": steps / duration_s if steps >= 0 and duration_s > 0 else None}
        if self.cfg.warmup_steps > 0 and not (self._first_step is not None and began_at is not None and (
                began_at >= self._first_step + self.cfg.warmup_steps)):
            out["warmup"] = True
        return out

    def _tick_fields(self) -> dict:
        """A tick's "step" (None before the first `set_step`) and "warmup": True while the instant is before the
        steady window (the interval's rule: before the first `warmup_steps` steps were done)."""
        first = self._first_step
        out = {"step": None if first is None else self.step}
        if self.cfg.warmup_steps > 0 and not (first is not None and self.step >= first + self.cfg.warmup_steps):
            out["warmup"] = True
        return out

    def _stack_samples(self, duration_s: float) -> dict:
        summary = self.stack_sampler.interval_summary()
        return {} if summary is None else {"stack_samples": summary}

    def _start_forensics(self) -> None:
        """Memory history, the dumper, threading.excepthook and the hang watchdog (profiler/forensics.py)."""
        if self.is_cuda:
            install_autotune_spans()   # triton's autotune windows become `triton.autotune` spans
        self.dumper = Forensics(self, make_memory_history(self.cfg.memory_history, self.is_cuda),
                                exit_fn=self.deps.exit_fn, wall_clock=self.wall_clock)
        self._cleanups.append(self.dumper.install())
        hang_s = self.cfg.hang_timeout_s
        self._started_with(Watchdog(hang_s, self.progress, lambda stalled_s: self.dumper.on_hang(stalled_s, hang_s))
                           if hang_s > 0 else NullWatchdog())

    def __exit__(self, et, ev, tb):
        try:
            self.captures.close()   # a live capture stops with the steps it ran (its event: at the final close)
            api.deactivate(self)   # later span() calls are no-ops; open spans still finish into buffers
            self.finish_now("ok" if et is None else et.__name__, settle=True)
        finally:
            self._run_cleanups()
        return False

    def _run_cleanups(self) -> None:
        """Undo what was started, newest first; each step runs even if an earlier one failed."""
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception:   # noqa: BLE001 - the rest must still be stopped
                logger.exception("profiler: cleanup step failed")

    def finish_now(self, status: str, settle: bool = False) -> None:
        """The final interval and run_end, once, also from a rank leaving without unwinding (forensics, any
        thread). Failures are logged, never raised; `settle`: first read back the checks in flight."""
        if not self._started:
            return
        self._started = False
        with contextlib.suppress(RuntimeError):   # RuntimeError: called on the collector thread
            self.collector.stop()
        steps = (lambda: self.nonfinite.settle(self.cfg.gpu_drain_timeout_s),) if settle else ()
        for step in (*steps, self._close_final, lambda: self._write(self._run_end_record(status))):
            try:
                step()
            except Exception:   # noqa: BLE001
                logger.exception("profiler: closing the run failed")

    def _close_final(self) -> None:
        if self.collector.lock.acquire(timeout=2.0):   # never wait forever on a stuck holder
            try:
                self.collector.close(final=True, gpu_drain_timeout_s=self.cfg.gpu_drain_timeout_s)
            finally:
                self.collector.lock.release()

    @property
    def disk_full(self) -> OSError | None:
        """The OSError with which the run log found the disk full (RunLog.full), or None."""
        return self.runlog.full

    # ---- collection ----------------------------------------------------------------------------
    def tick(self) -> bool:
        """One collector iteration in the caller's thread (for tests with background=False)."""
        return self.collector.tick()

    def close_interval(self, final: bool = False) -> dict:
        """Close the current interval now: append its `spans` (detail window) and `interval` records."""
        if not self._started:
            raise RuntimeError("close_interval(): the profiler is not running (use it inside `with`)")
        return self.collector.close(final, self.cfg.gpu_drain_timeout_s)

    @property
    def last_interval(self) -> dict | None:
        """The last interval record written (None before the first close)."""
        return self.collector.last_interval

    def set_step(self, step: int) -> None:
        """The current training step; its change is marked in time for the detail window (StepMarks)."""
        self.step = int(step)
        if self._first_step is None:
            self._first_step = self.step
        elif self.step != self._first_step:
            self._step_changed = True   # arms the hang watchdog: the first step's build is behind us
        self.marks.mark(time.perf_counter_ns(), self.step)
        self.step_peaks.on_step(self.step)   # the step that ended gets its allocator peak (host counters, no sync)
        self.captures.on_step(self.step)   # a capture starts, moves on or stops here, at the step boundary

    def in_detail(self) -> bool:
        """Whether the current step is in the detail window."""
        return self.marks.in_window

    def keep_step(self) -> None:
        """Keep the current step in the detail window (a follower's choice: ProfilerConfig.detail_follows)."""
        self.marks.keep_step()

    def progress(self) -> tuple:
        """(armed, token) for the hang watchdog: armed once the step changed; the token moves with every
        drained finished span and step change."""
        return self._step_changed, (self.step, self.collector.spans_finished)

    def to_unix_ns(self, perf_ns: int) -> int:
        """A span timestamp (perf_counter_ns) as Unix nanoseconds, through the run_start anchor."""
        return perf_ns - self.anchor_perf_ns + self.anchor_unix_ns

    # ---- records -------------------------------------------------------------------------------
    def _header(self, rtype: str) -> dict:
        return {"type": rtype, "time_unix": self.wall_clock(), "rank": self.rank, "role": self.role}

    def _write(self, rec: dict) -> dict:
        """Append to the run log, then one non-blocking put to the exporter thread (never run here or locked)."""
        rec = self.runlog.write(rec)
        self.hub.submit(rec)
        return rec

    def _run_start_record(self) -> dict:
        return {**self._header("run_start"), "schema": SCHEMA_VERSION, "run_id": self.run_id,
                "clock": {"perf_counter_ns": self.anchor_perf_ns, "unix_ns": self.anchor_unix_ns},
                "t_s": self.collector.run_start_s, "histogram_buckets_seconds": list(HISTOGRAM_BUCKETS_SECONDS),
                "detail_steps": self.cfg.detail_steps,
                "detail_follows": self.cfg.detail_follows, "world_size": self.world_size,
                "warmup_steps": self.cfg.warmup_steps, "phase_spans": list(self.cfg.phase_spans),
                "span_table": dict(self.cfg.span_table or {}), "memory_sizes": dict(self.cfg.memory_sizes or {}),
                "memory_caps": dict(self.cfg.memory_caps or {}),
                **host_fields(self.device, self.is_cuda), "floors": self.floors, "compute_peaks": self.compute_peaks,
                "interval_s": self.interval_s,
                "config": self.run_config}

    def _run_end_record(self, status: str) -> dict:
        duration_s = self.clock() - self.collector.run_start_s
        return {**self._header("run_end"), "step": self.step, "status": status, "duration_seconds": duration_s,
                "intervals": self.collector.intervals_closed, **self.collector.aggregator.run_parts(duration_s),
                "exporters": self.hub.stats(), **self._run_log_full()}

    def _run_log_full(self) -> dict:
        """run_end's `run_log` field, only once the disk filled: why, and how many records never got in."""
        full = self.runlog.full
        return {} if full is None else {"run_log": {"error": full.strerror, "dropped_records": self.runlog.dropped}}

    def event(self, kind: str, **fields) -> dict:
        """Write an {"type": "event", "kind": ...} record now; "step" defaults to the current step."""
        check_name(kind, "event kind")
        return self._write({**self._header("event"), "kind": kind, "step": self.step, **fields})

    def write_record(self, rtype: str, **fields) -> dict:
        """Write a record of another type (e.g. "snapshot") with the common header, which `fields` (from the
        endpoint's `record` command) cannot override: a client cannot forge another record type or rank."""
        return self._write({**fields, **self._header(rtype)})

    def corrupt(self, span_name: str, tensor, step=None, kinds=("nan", "drift")):
        return self.fault_plan.corrupt(span_name, self.step if step is None else step, tensor, kinds)

    def state(self) -> dict:
        """Live state for the control endpoint: open spans per thread (replayed first), last interval, the last two
        ticks (a window of the rank's own), step, pid, memory now."""
        try:
            self.collector.poll()
        except Exception:   # noqa: BLE001 - still report what we have
            logger.exception("profiler: state(): collecting records failed")
        return {"pid": os.getpid(), "rank": self.rank, "role": self.role, "step": self.step,
                "time_unix": self.wall_clock(), "run_dir": str(self.run_dir),
                "active_spans": self.recorder.open_spans(), "last_interval": self.last_interval,
                "intervals_closed": self.collector.intervals_closed, "ticks": self.collector.recent_ticks(),
                "memory": memory_state(self.sampler, self.device, interval=False)}

    # ---- forensics -----------------------------------------------------------------------------
    def check_finite(self, span_name: str, tensors: dict, step=None, **fields) -> None:
        """Flag NaN/Inf in `tensors` on the device; read back off this thread (profiler/nonfinite.py)."""
        self.nonfinite.check(span_name, self.step if step is None else step, tensors, **fields)

    def check_numerics(self, span_name: str, tensors: dict, step=None, **meta) -> None:
        """Statistics of `tensors` on the device at a sampled step (ProfilerConfig.numerics_every); read back off
        this thread into the numerics detector (profiler/numerics.py)."""
        step = self.step if step is None else step
        if self.cfg.numerics and step % self.cfg.numerics_every == 0:
            self.nonfinite.check_stats(span_name, step, tensors, **meta)

    def memory_sizes(self, sizes: dict) -> None:
        """The current step's sizes, kept with its allocator peak (profiler/memory_steps.py)."""
        self.step_peaks.sizes(sizes)

    def numerics_due(self, step=None) -> bool:
        """Whether `step` (default: the current one) is a sampled step of the numerics statistics."""
        return self.cfg.numerics and (self.step if step is None else step) % self.cfg.numerics_every == 0

    def _on_numerics_drift(self, warning: dict) -> None:
        """On the polling thread: the `numerics_drift` event (docs/RUNLOG.md), its counter and a console line (the
        profiler's logger: every rank says its own)."""
        self.event("numerics_drift", **warning)
        self.recorder.count("numerics_drift", 1)
        if warning["span"] not in self._drift_said:   # one line per span: a pack's K layers drift together
            self._drift_said.add(warning["span"])
            logger.warning("%s", drift_line(warning, self.rank, self.role))

    def _on_nonfinite(self, finding: dict) -> None:
        """On the collector thread: the `nonfinite` event (docs/RUNLOG.md) and its counters."""
        self.event("nonfinite", **finding, count=self.nonfinite.found)
        self.recorder.count("nonfinite", 1)
        if finding.get("action") == "skipped_step":
            self.recorder.count("nonfinite_skipped_steps", 1)


