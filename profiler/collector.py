"""The collector: drains the span logs, keeps the interval clock and aggregates, off the training threads. One
object owns the three, so an interval ends along one path, `close()`: boundary passed, forced, or the run's end."""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("profiler")

RECENT_TICKS = 2
"""Tick records the collector keeps for the control endpoint: two make one window of the rank's own."""


class Collector:
    """`poll()` drains the recorder into the aggregator and reads back the non-finite checks; `close()` writes
    the detail window's `spans` record, then the `interval` record (aggregates plus `sections`: duration_s ->
    more fields), then a `tick`. The thread polls every `poll_s`, writes a `tick` (cumulative totals:
    `write_tick()`) every `tick_s` on a grid of its own (regular samples for live rates), and closes past the
    boundary; `tick()` is one iteration. `tick_fields()`: a tick's "step" and, before the steady window, "warmup"
    (docs/RUNLOG.md)."""

    def __init__(self, recorder, aggregator, nonfinite, *, interval_s: float, clock, perf_clock: bool,
                 poll_s: float, header, write, step_fn, sections=(), tick_s: float | None = None,
                 tick_fields=lambda: {"step": None}):
        self.recorder, self.aggregator, self.nonfinite = recorder, aggregator, nonfinite
        self.interval_s, self.clock, self.perf_clock, self.poll_s = interval_s, clock, perf_clock, poll_s
        self._header, self._write, self._step_fn, self._sections = header, write, step_fn, tuple(sections)
        self.tick_s, self._tick_fields = interval_s if tick_s is None else tick_s, tick_fields
        self.next_tick_s = clock() + self.tick_s
        self.ticks_written = 0
        self.last_ticks: list = []          # the last RECENT_TICKS tick records written, oldest first
        self.lock = threading.RLock()        # one drain or close at a time; records keep index order
        self.start_ns = time.perf_counter_ns()
        self.run_start_s = self.start_s = self._clock_s(self.start_ns)
        self.next_boundary_s = clock() + interval_s
        self.intervals_closed = 0
        self.last_interval: dict | None = None
        self.spans_finished = 0              # spans drained so far (the hang watchdog's progress)
        self.last_finished: dict = {}        # thread name -> the SpanRecord that ended last on it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = False

    # ---- the thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="profiler.collector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (RuntimeError when called on it: forensics leaving from the collector)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            # Wake at the boundary or tick itself when it comes before the next poll (accurate durations).
            due_s = min(self.next_boundary_s, self.next_tick_s)
            if self._stop.wait(min(self.poll_s, max(0.0, due_s - self.clock()))):
                return
            self.tick()

    def tick(self) -> bool:
        """One iteration: close the interval if its boundary passed, else write a tick if one is due, else poll.
        True if it closed. A failure is logged once and the collector goes on (telemetry never kills training)."""
        try:
            now_s = self.clock()
            if now_s >= self.next_boundary_s:
                self.close()
                return True
            if now_s >= self.next_tick_s:
                self.write_tick()
            else:
                self.poll()
        except Exception:   # noqa: BLE001
            if not self._logged:
                self._logged = True
                logger.exception("profiler: interval collection failed (logged once; continuing)")
        return False

    # ---- draining --------------------------------------------------------------------------------
    def poll(self) -> None:
        self.nonfinite.poll()   # Event.query() only: never a wait
        with self.lock:
            self._drain(None)

    def _drain(self, boundary_ns: int | None) -> None:
        """The span logs into the aggregator; `boundary_ns` when closing an interval there."""
        drained = self.recorder.drain()
        for thread_name, spans, _ in drained:
            if spans:   # finished in end order: the last one ended last (an OOM's span, unwinding)
                self.spans_finished += len(spans)
                self.last_finished[thread_name] = spans[-1]
        self.aggregator.add_drained(drained, boundary_ns)

    def last_finished_span(self, thread_name: str) -> dict | None:
        """The span that ended last on a thread, and how long ago (forensics: the span an exception unwound)."""
        self.poll()
        found = self.last_finished.get(thread_name)
        if found is None:
            return None
        return {"name": found.name, "ended_seconds_ago": (time.perf_counter_ns() - found.t1_ns) / 1e9}

    def _clock_s(self, perf_ns: int) -> float:
        """The interval clock at `perf_ns` (the same instant on the default clock; an injected one is read now)."""
        return perf_ns / 1e9 if self.perf_clock else self.clock()

    def _wait_pending(self, timeout_s: float) -> None:
        """At run end, poll Event.query() (never a synchronize) up to timeout_s; pairs still pending count
        CPU-only (the span's "gpu_unresolved")."""
        deadline = time.monotonic() + timeout_s
        while self.aggregator.resolve_pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.aggregator.add_unresolved()

    # ---- closing ---------------------------------------------------------------------------------
    def close(self, final: bool = False, gpu_drain_timeout_s: float = 0.0) -> dict:
        """End the interval now: write its `spans` (detail window) and `interval` records; returns the latter.
        A close at or past the boundary keeps the interval grid; an earlier one restarts the clock."""
        with self.lock:
            # The boundary is read before the drain: a span that ends after it but is drained now has the part
            # past it carried to the next interval; every span begun before it is in the open stacks (or
            # finished) once the drain is done.
            end_ns = time.perf_counter_ns()
            self._drain(end_ns)
            if final:
                self._wait_pending(gpu_drain_timeout_s)
            rec = self._interval_record(end_ns, final)
            detail = self.aggregator.detail.take()
            if detail is not None:
                self._write({**self._header("spans"), "index": self.intervals_closed, **detail})
            self.start_s, self.start_ns = rec["end_s"], end_ns
            self.intervals_closed += 1
            self._next_boundary()
            self.last_interval = rec = self._write(rec)
            # The interval's instant, its closed totals (time carried past the boundary goes to the next tick).
            self._write_tick_record(rec["time_unix"], rec["end_s"], self.aggregator.tick_parts(), final)
            if self.tick_s >= self.interval_s:   # only the closes' ticks: the next tick never comes before a close
                self.next_tick_s = self.clock() + self.tick_s
            self._next_tick()                    # a grid tick due now was this one
        return rec

    def write_tick(self) -> dict:
        """Write a `tick` record now: cumulative counters and span totals, open spans' elapsed time included."""
        self.nonfinite.poll()   # Event.query() only: never a wait
        with self.lock:
            tick_ns, time_unix = time.perf_counter_ns(), self._header("tick")["time_unix"]
            self._drain(None)
            parts = self.aggregator.tick_parts(tick_ns, self.recorder.open_spans(ids=True))
            rec = self._write_tick_record(time_unix, self._clock_s(tick_ns), parts, False)
            self._next_tick()
            return rec

    def _next_tick(self) -> None:
        now_s = self.clock()
        while self.next_tick_s <= now_s:   # on the grid; ticks missed by a stalled thread skipped
            self.next_tick_s += self.tick_s

    def _write_tick_record(self, time_unix: float, t_s: float, parts: dict, final: bool) -> dict:
        rec = {**self._header("tick"), "time_unix": time_unix, "index": self.ticks_written, "t_s": t_s,
               **self._tick_fields()}
        if final:
            rec["final"] = True
        self.ticks_written += 1
        rec = self._write({**rec, **parts})
        self.last_ticks = [*self.last_ticks, rec][-RECENT_TICKS:]   # a new list: readers never see it change
        return rec

    def recent_ticks(self) -> list:
        """The last RECENT_TICKS tick records, oldest first: a client's window over the rank's latest tick_s (the
        control endpoint's state; `dflash-profile top`)."""
        return list(self.last_ticks)

    def _interval_record(self, end_ns: int, final: bool) -> dict:
        end_s = self._clock_s(end_ns)
        duration_s = (end_ns - self.start_ns) / 1e9 if self.perf_clock else end_s - self.start_s
        open_spans = self.recorder.open_spans(ids=True)
        rec = {**self._header("interval"), "index": self.intervals_closed, "step": self._step_fn(),
               "start_s": self.start_s, "end_s": end_s, "duration_seconds": duration_s,
               **self.aggregator.close_parts(duration_s, end_ns, open_spans)}
        for section in self._sections:
            rec.update(section(duration_s))
        rec["open_spans"] = _without_ids(open_spans)
        if final:
            rec["final"] = True
        return rec

    def _next_boundary(self) -> None:
        now_s = self.clock()
        if now_s < self.next_boundary_s:       # closed early: a whole interval from now
            self.next_boundary_s = now_s + self.interval_s
        while self.next_boundary_s <= now_s:   # on the grid; missed boundaries (a stalled thread) skipped
            self.next_boundary_s += self.interval_s


def _without_ids(open_spans: list) -> list:
    """open_spans(ids=True) as the run log documents it: without the ids and begin times the aggregator uses."""
    return [{**entry, "spans": [{k: v for k, v in s.items() if k not in ("id", "t0_ns")} for s in entry["spans"]]}
            for entry in open_spans]
