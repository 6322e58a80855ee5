"""The Profiler: ties spans, CUDA timing, intervals, memory, floors, control and the run log together."""
from __future__ import annotations

import contextlib
import logging
import os
import platform
import socket
import sys
import threading
import time
from pathlib import Path

from profiler import api
from profiler.control import ControlServer, NullControlServer
from profiler.cuda_timing import GpuSampler
from profiler.detail import DETAIL_ALIGN, DetailWindow, NullDetailWindow, StepMarks
from profiler.export import CallableExporter, ExportHub
from profiler.faults import FaultPlan
from profiler.floors import floor_for_span, measure_floors as _measure_floors
from profiler.forensics import Forensics, install_autotune_spans, make_memory_history
from profiler.intervals import IntervalAggregator, IntervalTimer
from profiler.memory import allocator_summary, make_memory_sampler
from profiler.nonfinite import NonfiniteMonitor
from profiler.records import SCHEMA_VERSION
from profiler.runlog import RunLog
from profiler.spans import SpanRecorder, check_name
from profiler.stacks import NullStackSampler
from profiler.stats import HISTOGRAM_BUCKETS_SECONDS
from profiler.threadcpu import ThreadCpu, profiler_share
from profiler.watchdog import NullWatchdog, Watchdog

logger = logging.getLogger("profiler")

def check_interval_s(interval_s) -> float:
    """interval_s as a float; ValueError unless it is a positive number of seconds."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
        raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    return float(interval_s)


class Profiler:
    """Per-process profiler; `with Profiler(...) as prof:` makes it the active one (see profiler_api.md).

    Extra keyword-only knobs for tests and embedding: `wall_clock` (time_unix source), `poll_s`
    (collector poll period), `background` (False: no collector thread; drive it with `tick()`),
    `fault_plan`, `event_pool` (CUDA event pool or a fake), `floors` (skip the
    measurement and use these), `gpu_drain_timeout_s` (how long run end polls pending GPU pairs),
    `exporters` (objects with name/export/close, fed on the exporter thread: profiler/export.py),
    `detail_steps` (steps per interval kept as raw spans), `run_id` (default: the run dir's name),
    `stack_sampler` (in-run py-spy sampling; profiler/stacks.py), `export_timeout_s` (close deadline),
    `hang_timeout_s` (> 0: the hang watchdog, profiler/watchdog.py), `memory_history` (CUDA allocator
    history entries kept for an OOM snapshot; 0 = off), `exit_fn` (how forensics leave a stuck rank),
    `gpu_steps_per_s` (> 0: CUDA spans time the GPU on about this many steps a second at most, at random, and
    on every detail-window step: profiler/cuda_timing.py GpuSampler; 0 = every step), `gpu_rng` (its
    random.Random, for tests)."""

    def __init__(self, run_dir, rank: int = 0, world_size: int = 1, role: str = "main", interval_s=60.0,
                 device=None, config=None, faults: str = "", clock=None, memory_sampler=None, nvml=None,
                 measure_floors: bool = True, control: bool = True, *, wall_clock=time.time,
                 poll_s: float = 0.25, background: bool = True, fault_plan=None,
                 event_pool=None, floors: dict | None = None, gpu_drain_timeout_s: float = 2.0,
                 exporters=(), detail_steps: int = 3, run_id: str | None = None, stack_sampler=None,
                 export_timeout_s: float = 5.0, hang_timeout_s: float = 0.0, memory_history: int = 0,
                 exit_fn=os._exit, gpu_steps_per_s: float = 0.0, gpu_rng=None):
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Profiler: rank must be a non-negative int, got {rank!r}")
        if not isinstance(role, str) or not role:
            raise ValueError(f"Profiler: role must be a non-empty string, got {role!r}")
        self.run_dir = Path(run_dir)
        self.rank, self.world_size, self.role = rank, world_size, role
        self.interval_s = check_interval_s(interval_s)
        self.device = device
        self.is_cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
        self.config = config
        self.clock = clock or time.perf_counter
        # On the default clock, interval bounds are read once in span time (perf_counter_ns) and the
        # seconds derived from it, so a span open a whole interval holds exactly 100% of it.
        self._perf_clock = clock is None or clock is time.perf_counter
        self.wall_clock = wall_clock
        self.poll_s = poll_s
        self.background = background
        self._memory_sampler_arg, self._nvml = memory_sampler, nvml
        self._measure_floors, self.floors = measure_floors, floors
        self._control_enabled = control
        self._fault_plan_arg, self._faults, self._event_pool_arg = fault_plan, faults, event_pool
        self.log_path = self.run_dir / "profile" / f"rank{rank}.jsonl"
        self.step = 0
        self.last_interval = None
        self.intervals_closed = 0
        self.gpu_drain_timeout_s = gpu_drain_timeout_s
        self.hub = ExportHub(exporters)
        self.export_timeout_s = export_timeout_s
        self.detail_steps = detail_steps
        self.gpu_sampler = GpuSampler(gpu_steps_per_s, self._detail_burst(), gpu_rng)   # raises on a bad value
        self.run_id = run_id or self.run_dir.resolve().name
        self.stack_sampler = stack_sampler or NullStackSampler()
        self.marks = StepMarks()
        self._close_lock = threading.RLock()
        self._started = False
        self.hang_timeout_s, self._memory_history_entries, self._exit_fn = hang_timeout_s, memory_history, exit_fn
        self.last_finished: dict = {}    # thread name -> (span name, end perf_counter_ns)
        self.spans_finished = 0          # progress for the hang watchdog: spans drained so far...
        self._first_step = None          # ...and the step, once it changed from the first one set
        self._step_changed = False
        self._forensics: dict = {}   # name -> fn() giving state for forensics dumps

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
        self.runlog = RunLog(self.log_path)
        self._cleanups.append(self.runlog.close)
        if self.floors is None:
            self.floors = _measure_floors(self.device) if self._measure_floors else {}
        self.fault_plan = self._fault_plan_arg or FaultPlan.from_spec(self._faults, self.rank)
        pool = self._event_pool_arg
        if pool is None and self.is_cuda:
            from profiler.cuda_timing import EventPool
            pool = EventPool(device_index=self.device.index)   # None: the current device
        self.event_pool = pool
        self.recorder = SpanRecorder(event_pool=pool, fault_plan=self.fault_plan, step_fn=lambda: self.step,
                                     gpu_sampler=self.gpu_sampler)
        self.nonfinite = NonfiniteMonitor(self.rank, self._on_nonfinite,
                                          readback=_readback(self.is_cuda, self.device, pool))
        self.anchor_perf_ns, self.anchor_unix_ns = time.perf_counter_ns(), int(self.wall_clock() * 1e9)
        detail = (DetailWindow(self.detail_steps, self.marks, self.to_unix_ns, self.recorder.native_ids)
                  if self.detail_steps > 0 else NullDetailWindow())
        self.aggregator = IntervalAggregator(self.floors, floor_for_span, self.is_cuda, pool, detail)
        self.hub.start()
        self._cleanups.append(lambda: self.hub.close(self.export_timeout_s))
        self.sampler = self._memory_sampler_arg or make_memory_sampler(self.device, nvml=self._nvml)
        self.sampler.start()
        self._cleanups.append(self.sampler.stop)
        self.interval_start_ns = time.perf_counter_ns()
        self.thread_cpu = ThreadCpu()
        self.start_s = self.interval_start_s = self._clock_s(self.interval_start_ns)
        self.start_unix = self.wall_clock()
        self._write(self._run_start_record())
        self._start_forensics()
        api.activate(self, self.recorder)
        self._cleanups.append(lambda: api.deactivate(self))
        self.timer = IntervalTimer(self.interval_s, self.clock, self._timer_poll, self._timer_close, self.poll_s)
        self.control = (ControlServer(self.run_dir, self.rank, self.role, self.state,
                                      record_fn=lambda fields: self.write_record("snapshot", **fields))
                        if self._control_enabled else NullControlServer())
        self.control.start()
        self._cleanups.append(self.control.close)
        self.stack_sampler.start()
        self._cleanups.append(self.stack_sampler.stop)
        if self.background:
            self.timer.start()
            self._cleanups.append(self.timer.stop)
        self._started = True

    def _start_forensics(self) -> None:
        """Memory history, the dumper, threading.excepthook and the hang watchdog (profiler/forensics.py)."""
        self.memory_history = make_memory_history(self._memory_history_entries, self.is_cuda)
        self.memory_history.start()
        if self.is_cuda:
            install_autotune_spans()   # triton's autotune windows become `triton.autotune` spans
        self.dumper = Forensics(self, self.memory_history, exit_fn=self._exit_fn, wall_clock=self.wall_clock)
        previous_hook, threading.excepthook = threading.excepthook, self.dumper.excepthook
        self._cleanups.append(lambda: setattr(threading, "excepthook", previous_hook))
        self.watchdog = (Watchdog(self.hang_timeout_s, self.progress, self._on_hang) if self.hang_timeout_s > 0
                         else NullWatchdog())
        self.watchdog.start()
        self._cleanups.append(self.watchdog.stop)

    def __exit__(self, et, ev, tb):
        status = "ok" if et is None else et.__name__
        try:
            if self._started:
                self.timer.stop()
                api.deactivate(self)   # later span() calls are no-ops; open spans still finish into buffers
                # Telemetry never kills training: a failure here is logged, and the with-block's own
                # exception (if any) is what propagates.
                for step in (self._drain_nonfinite, lambda: self.close_interval(final=True),
                             lambda: self._write(self._run_end_record(status))):
                    try:
                        step()
                    except Exception:   # noqa: BLE001
                        logger.exception("profiler: closing the run failed")
        finally:
            self._run_cleanups()
            self._started = False
        return False

    def _run_cleanups(self) -> None:
        """Undo what was started, newest first; each step runs even if an earlier one failed."""
        while self._cleanups:
            fn = self._cleanups.pop()
            try:
                fn()
            except Exception:   # noqa: BLE001 - the rest must still be stopped
                logger.exception("profiler: cleanup step failed")

    # ---- collection ----------------------------------------------------------------------------
    def _poll(self) -> None:
        self.nonfinite.poll()   # Event.query() only: on the collector thread, never a wait
        with self._close_lock:
            self._add_drained()

    def _add_drained(self, boundary_ns: int | None = None) -> None:
        """Drain the span logs into the aggregator; `boundary_ns` when closing an interval there."""
        drained = self.recorder.drain()
        for thread_name, spans, _ in drained:
            if spans:   # finished in end order: the last one ended last (an OOM's span, unwinding)
                self.spans_finished += len(spans)
                self.last_finished[thread_name] = (spans[-1][0], spans[-1][2])
        self.aggregator.add_drained(drained, boundary_ns)

    def _clock_s(self, perf_ns: int) -> float:
        """The profiler clock's reading for an interval bound read at `perf_ns` (the same instant on the
        default clock; an injected clock is read now)."""
        return perf_ns / 1e9 if self._perf_clock else self.clock()

    def last_finished_span(self, thread_name: str) -> dict | None:
        """The span that ended last on a thread, and how long ago (forensics: the span an
        exception unwound through, once the collector has drained it)."""
        self._poll()
        found = self.last_finished.get(thread_name)
        if found is None:
            return None
        return {"name": found[0], "ended_seconds_ago": (time.perf_counter_ns() - found[1]) / 1e9}

    def _timer_poll(self) -> None:
        self._poll()

    def _timer_close(self) -> None:
        self.close_interval(_reset_timer=False)

    def tick(self) -> bool:
        """One collector iteration in the caller's thread (for tests with background=False)."""
        return self.timer.tick()

    def close_interval(self, final: bool = False, _reset_timer: bool = True) -> dict:
        """Close the current interval now: append its `spans` (detail window) and `interval`
        records."""
        if not self._started:
            raise RuntimeError("close_interval(): the profiler is not running (use it inside `with`)")
        with self._close_lock:
            # The boundary is read before the drain: a span that ends after it but is drained now has
            # the part past it carried to the next interval; every span begun before it is in the
            # open stacks (or finished) once the drain is done.
            end_ns = time.perf_counter_ns()
            self._add_drained(end_ns)
            if final:
                self.recorder.release_tails()   # span() is a no-op now: no begin will share them
                if self.aggregator.pending:
                    self._wait_pending()
            end_s = self._clock_s(end_ns)
            duration_s = ((end_ns - self.interval_start_ns) / 1e9 if self._perf_clock
                          else end_s - self.interval_start_s)
            open_spans = self.recorder.open_spans(ids=True)
            cpu = self.thread_cpu.take()
            rec = {**self._header("interval"), "index": self.intervals_closed, "step": self.step,
                   "start_s": self.interval_start_s, "end_s": end_s, "duration_seconds": duration_s,
                   **self.aggregator.close_parts(duration_s, end_ns, open_spans), "memory": self._memory_summary(),
                   "threads": [{"name": n, "native_id": t} for n, t in sorted(self.recorder.native_ids.items())],
                   "threads_cpu_seconds": cpu, "profiler_share": profiler_share(cpu, duration_s),
                   "exporters": self.hub.stats(), "open_spans": _without_ids(open_spans)}
            stacks = self.stack_sampler.interval_summary(reset=True)
            if stacks is not None:
                rec["stack_samples"] = stacks
            if final:
                rec["final"] = True
            detail = self.aggregator.detail.take(time.perf_counter_ns())
            self.gpu_sampler.interval_closed(duration_s, self._detail_burst())   # next window's steps timed whole
            if detail is not None:
                self._write({**self._header("spans"), "index": self.intervals_closed, **detail})
            self.interval_start_s, self.interval_start_ns = end_s, end_ns
            self.intervals_closed += 1
            if _reset_timer and not final:
                self.timer.reset_boundary()
            rec = self.last_interval = self._write(rec)   # under the lock: records keep index order
        return rec

    def _memory_summary(self) -> dict:
        """NVML aggregates and allocator stats of the interval; telemetry never kills training."""
        try:
            memory = dict(self.sampler.interval_summary(reset=True))
        except Exception as exc:   # noqa: BLE001
            memory = {"available": False, "reason": f"memory sampler failed: {type(exc).__name__}: {exc}"}
        try:
            memory["allocator"] = allocator_summary(self.device, reset_peak=True)
        except Exception as exc:   # noqa: BLE001
            memory["allocator"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        return memory

    def _wait_pending(self) -> None:
        """At run end, give queued GPU work a moment to complete by polling Event.query() (never a
        synchronize); what is still pending after gpu_drain_timeout_s is reported CPU-only, counted
        in the span's "gpu_unresolved"."""
        deadline = time.monotonic() + self.gpu_drain_timeout_s
        while self.aggregator.resolve_pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.aggregator.add_unresolved()

    # ---- records -------------------------------------------------------------------------------
    def _header(self, rtype: str) -> dict:
        return {"type": rtype, "time_unix": self.wall_clock(), "rank": self.rank, "role": self.role}

    def _write(self, rec: dict) -> dict:
        """Append to the run log, then hand the record as written to the exporter thread (one
        non-blocking put: exporters never run on this thread or under a profiler lock)."""
        rec = self.runlog.write(rec)
        self.hub.submit(rec)
        return rec

    def add_listener(self, fn) -> None:
        """Call fn(record) on the exporter thread for every record written from now on."""
        self.hub.add(CallableExporter(fn))
        self.hub.start()

    def set_step(self, step: int) -> None:
        """The current training step; its change is marked in time for the detail window."""
        self.marks.mark(self.note_step(step), self.step)
        self.gpu_sampler.next_step()

    def _detail_burst(self) -> int:
        """Steps to time whole from an interval's start: enough to cover its detail window, which begins on
        the first step that is a multiple of DETAIL_ALIGN (profiler/detail.py)."""
        return self.detail_steps + DETAIL_ALIGN if self.detail_steps > 0 else 0

    def note_step(self, step: int) -> int:
        """The step and when it was set (perf_counter_ns, returned)."""
        self.step = int(step)
        if self._first_step is None:
            self._first_step = self.step
        elif self.step != self._first_step:
            self._step_changed = True   # arms the hang watchdog: the first step's build is behind us
        return time.perf_counter_ns()

    def progress(self) -> tuple:
        """(armed, token) for the hang watchdog: armed once the step changed; the token changes
        whenever a span finished (as drained by the collector) or the step changed."""
        return self._step_changed, (self.step, self.spans_finished)

    def _on_hang(self, stalled_s: float) -> None:
        """On the watchdog's thread: say it, dump, write run_end and leave (profiler/forensics.py)."""
        print(f"profiler: rank {self.rank}: no progress for {stalled_s:.1f} s (hang timeout "
              f"{self.hang_timeout_s:g} s); stopping with a dump in {self.run_dir / 'forensics'}",
              file=sys.stderr, flush=True)
        self.dumper.abort("hang", "hang", stalled_seconds=stalled_s, timeout_seconds=self.hang_timeout_s)

    def finish_now(self, status: str) -> None:
        """The run's end from any thread, for a rank about to leave without unwinding (forensics):
        the final interval and run_end; the with-block's exit then writes nothing more."""
        if not self._started:
            return
        with contextlib.suppress(RuntimeError):   # RuntimeError: called on the collector thread
            self.timer.stop()
        if self._close_lock.acquire(timeout=2.0):   # never wait forever on a stuck holder
            try:
                self.close_interval(final=True)
            except Exception:   # noqa: BLE001 - run_end must still be written
                logger.exception("profiler: final interval failed")
            finally:
                self._close_lock.release()
        self._write(self._run_end_record(status))
        self._started = False

    def to_unix_ns(self, perf_ns: int) -> int:
        """A span timestamp (perf_counter_ns) as Unix nanoseconds, through the run_start anchor."""
        return perf_ns - self.anchor_perf_ns + self.anchor_unix_ns

    def _run_start_record(self) -> dict:
        try:
            import torch
            torch_version = torch.__version__
            device_name = (torch.cuda.get_device_name(self.device) if self.is_cuda
                           else platform.processor() or platform.machine() or "cpu")
        except Exception as exc:   # noqa: BLE001
            torch_version, device_name = None, f"unknown ({type(exc).__name__})"
        return {**self._header("run_start"), "schema": SCHEMA_VERSION, "run_id": self.run_id,
                "clock": {"perf_counter_ns": self.anchor_perf_ns, "unix_ns": self.anchor_unix_ns},
                "histogram_buckets_seconds": list(HISTOGRAM_BUCKETS_SECONDS), "detail_steps": self.detail_steps,
                "gpu_steps_per_s": self.gpu_sampler.max_steps_per_s,
                "version": _package_version(), "world_size": self.world_size, "pid": os.getpid(),
                "hostname": socket.gethostname(), "python_version": platform.python_version(),
                "torch_version": torch_version, "device": str(self.device) if self.device is not None else "cpu",
                "device_name": device_name, "floors": self.floors, "interval_s": self.interval_s,
                "config": self.config}

    def _run_end_record(self, status: str) -> dict:
        duration_s = self.clock() - self.start_s
        return {**self._header("run_end"), "step": self.step, "status": status, "duration_seconds": duration_s,
                "intervals": self.intervals_closed, **self.aggregator.run_parts(duration_s),
                "exporters": self.hub.stats()}

    def event(self, kind: str, **fields) -> dict:
        """Write an {"type": "event", "kind": ...} record now; "step" defaults to the current step."""
        check_name(kind, "event kind")
        rec = {**self._header("event"), "kind": kind, "step": self.step, **fields}
        self._write(rec)
        return rec

    def write_record(self, rtype: str, **fields) -> dict:
        """Write a record of another type (e.g. "snapshot") with the common header, which `fields` (from the
        endpoint's `record` command) cannot override: a client cannot forge another record type or rank."""
        rec = {**fields, **self._header(rtype)}
        self._write(rec)
        return rec

    def corrupt(self, span_name: str, tensor, step=None):
        return self.fault_plan.corrupt(span_name, self.step if step is None else step, tensor)

    # ---- forensics -----------------------------------------------------------------------------
    def check_finite(self, span_name: str, tensors: dict, step=None, **fields) -> None:
        """Flag NaN/Inf in `tensors` on the device; read back off this thread (profiler/nonfinite.py)."""
        self.nonfinite.check(span_name, self.step if step is None else step, tensors, **fields)

    def _on_nonfinite(self, finding: dict) -> None:
        """On the collector thread: the `nonfinite` event (docs/RUNLOG.md) and its counters."""
        self.event("nonfinite", **finding, count=self.nonfinite.found)
        self.recorder.count("nonfinite", 1)
        if finding.get("action") == "skipped_step":
            self.recorder.count("nonfinite_skipped_steps", 1)

    def _drain_nonfinite(self) -> None:
        """At run end, read the checks still in flight (Event.query() polling, never a wait)."""
        self.nonfinite.settle(self.gpu_drain_timeout_s)

    def register_forensics(self, name: str, fn) -> None:
        """fn() -> JSON-able state that forensics dumps include under `name` (a hang, a crash)."""
        self._forensics[check_name(name, "forensics")] = fn

    def forensics(self) -> dict:
        """Every registered forensics source's state now; a failing source gives its error instead."""
        out = {}
        for name, fn in list(self._forensics.items()):
            try:
                out[name] = fn()
            except Exception as exc:   # noqa: BLE001 - a dump must still come out
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def state(self) -> dict:
        """Live state for the control endpoint: open spans per thread with how long each has been
        open (from the collector-side stacks, read under the drain lock: safe from any thread),
        last interval record, step, pid, latest memory sample."""
        try:
            self._poll()   # replay the logs so the open-span stacks are current
        except Exception:   # noqa: BLE001 - still report what we have
            logger.exception("profiler: state(): collecting records failed")
        try:
            memory = dict(self.sampler.latest())
        except Exception as exc:   # noqa: BLE001
            memory = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        try:   # ~150 us, only when someone asks for a snapshot; the peaks stay for the interval
            memory["allocator"] = allocator_summary(self.device, reset_peak=False)
        except Exception as exc:   # noqa: BLE001
            memory["allocator"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        return {"pid": os.getpid(), "rank": self.rank, "role": self.role, "step": self.step,
                "time_unix": self.wall_clock(), "run_dir": str(self.run_dir),
                "active_spans": self.recorder.open_spans(), "last_interval": self.last_interval,
                "intervals_closed": self.intervals_closed, "memory": memory}



def _readback(is_cuda: bool, device, pool):
    """How this rank's non-finite checks come back from the device (profiler/nonfinite.py): None on a CPU
    run. The stream lookup is the event pool's cached one, or torch's where a test's pool has no streams."""
    if not is_cuda:
        return None
    import torch
    from profiler.nonfinite import CudaReadback
    current = pool.current if pool is not None and pool.current() is not None else (
        lambda: torch.cuda.current_stream(device))
    return CudaReadback(device, current)


def _without_ids(open_spans: list) -> list:
    """open_spans(ids=True) as the run log documents it: the span ids and begin times (which only the
    aggregator needs) left out."""
    return [{**entry, "spans": [{k: v for k, v in s.items() if k not in ("id", "t0_ns")} for s in entry["spans"]]}
            for entry in open_spans]


def _package_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("dflash-observability")
    except Exception:   # noqa: BLE001 - running from a source tree without installing
        return None
