"""Kineto captures on demand: a few steps of torch.profiler, started and stopped at a step boundary on the
training thread, aligned across ranks by the step they begin at.

A request (the control endpoint's `capture` command, or the run's schedule) names a future step N and K steps.
At `set_step(N - 1)` the training thread prepares torch.profiler (Kineto's warm-up: its set-up cost lands before
the capture), at `set_step(N)` it starts recording (CPU and, on CUDA, CUDA activities; every thread) and has
every span also be a `record_function` range (SpanRecorder.set_ranges: new span objects of a subclass, so
outside a capture the spans cost what they did); at `set_step(N + K)` it stops it and writes
RUN_DIR/kineto/rank{R}-step{N}.json.gz, a Kineto trace with `distributedInfo` and `ProfilerStep#N`..., which
Perfetto and Holistic Trace Analysis read. No rank waits on another: ranks agree because they are asked for the
same N. The collector keeps our own spans that began in the captured steps (CaptureSpans) and, once they have
finished and their GPU windows resolved, writes one `capture` event naming the file (docs/RUNLOG.md).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("profiler")

MAX_STEPS = 20
"""The most steps one capture records: its file grows with each (the `capture` event says by how much)."""
SETTLE_S = 10.0
"""Seconds a stopped capture waits for its spans to finish before its event is written without them."""
KINETO_DIR = "kineto"


def trace_path(run_dir, rank: int, step: int) -> Path:
    return Path(run_dir) / KINETO_DIR / f"rank{rank}-step{step}.json.gz"


@dataclass(frozen=True)
class CaptureRequest:
    """K steps from step N; the torch.profiler options a user may ask for (all off: their cost is not small)."""
    at_step: int
    steps: int
    memory: bool = False
    """torch.profiler's profile_memory: every allocation and free in the trace."""
    shapes: bool = False
    """record_shapes: each op's input shapes."""
    stacks: bool = False
    """with_stack: each op's Python stack."""
    source: str = "control"


def _int(fields: dict, key: str, least: int, most: int | None = None) -> int:
    value = fields.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        bound = f"between {least} and {most}" if most is not None else f">= {least}"
        raise ValueError(f"capture: {key} must be an integer {bound}, got {value!r}")
    return value


def parse_request(fields: dict, step: int) -> CaptureRequest:
    """A CaptureRequest from the endpoint's fields, for a rank now at `step`; ValueError (one line) otherwise."""
    at_step, steps = _int(fields, "at_step", 0), _int(fields, "steps", 1, MAX_STEPS)
    if at_step <= step:
        raise ValueError(f"already at step {step}, past step {at_step}: a capture starts at a later step")
    flags = {k: fields.get(k, False) for k in ("memory", "shapes", "stacks")}
    bad = [k for k, v in flags.items() if not isinstance(v, bool)]
    if bad:
        raise ValueError(f"capture: {bad[0]} must be true or false, got {fields[bad[0]]!r}")
    return CaptureRequest(at_step, steps, **flags)


@dataclass(frozen=True)
class CaptureSchedule:
    """Captures at step `at_step`, and every `every` steps after it (0: once), of `steps` steps each."""
    at_step: int
    steps: int
    every: int = 0

    def due(self, step: int) -> bool:
        if step < self.at_step:
            return False
        return step == self.at_step or (self.every > 0 and (step - self.at_step) % self.every == 0)


class NullSchedule:
    def due(self, step: int) -> bool:
        return False


@dataclass
class Window:
    """One capture as the collector sees it: its time range (perf_counter_ns), its step boundaries, the spans
    that began in it, and the `capture` event's fields once the training thread stopped it."""
    request: CaptureRequest
    t0_ns: int
    marks: list = field(default_factory=list)     # [(step, t_ns)] boundaries, the first at t0_ns
    t1_ns: int | None = None
    fields: dict | None = None                    # set when stopped (the training thread), with t1_ns
    stopped_s: float = 0.0
    spans: list = field(default_factory=list)

    def step_at(self, t_ns: int):
        step = None
        for s, t in self.marks:   # a few steps: a scan is enough
            if t > t_ns:
                break
            step = s
        return step

    def holds(self, t_ns: int) -> bool:
        return t_ns >= self.t0_ns and (self.t1_ns is None or t_ns < self.t1_ns)


class CaptureSpans:
    """The collector's side, in the detail window's place (`offer`, `take`, both passed on to `inner`): keeps each
    finished span that began in a capture, and writes a stopped capture's event once none of its spans is open
    or awaits its GPU window (or SETTLE_S passed, or the run ends). `open_spans()` gives the open spans with their
    begin times (SpanRecorder.open_spans(ids=True)); `pending` is the aggregator's list of (thread name,
    SpanRecord) awaiting their GPU window, read here, changed only by the aggregator."""

    def __init__(self, inner, write_event, to_unix_ns, native_ids: dict, open_spans, pending: list,
                 clock=time.monotonic):
        self.inner, self.write_event, self.to_unix_ns, self.native_ids = inner, write_event, to_unix_ns, native_ids
        self.open_spans, self.pending, self.clock = open_spans, pending, clock
        self.windows: list = []     # appended by the training thread; read and trimmed here
        self.final = False          # the run ends: the next take() writes every stopped capture as it is

    def offer(self, done) -> None:
        self.inner.offer(done)
        windows = list(self.windows)
        if not windows:
            return
        for thread_name, rec, gpu_s in done:
            for w in windows:
                if w.holds(rec.t0_ns):
                    w.spans.append(self._entry(w, thread_name, rec, gpu_s))
        self._flush()

    def take(self):
        out = self.inner.take()
        self._flush()
        return out

    def _entry(self, w: Window, thread_name: str, rec, gpu_s) -> dict:
        return {"name": rec.name, "thread": thread_name, "tid": self.native_ids.get(thread_name), "depth": rec.depth,
                "step": w.step_at(rec.t0_ns), "start_unix_ns": self.to_unix_ns(rec.t0_ns),
                "end_unix_ns": self.to_unix_ns(rec.t1_ns), "cpu_seconds": (rec.t1_ns - rec.t0_ns) / 1e9,
                "gpu_seconds": gpu_s, "bytes": rec.bytes}

    def _unfinished(self, w: Window) -> int:
        """Spans begun in the capture that are still open or await their GPU window."""
        starts = [s["t0_ns"] for entry in self.open_spans() for s in entry["spans"]]
        starts += [rec.t0_ns for _thread, rec in self.pending]
        return sum(1 for t in starts if w.holds(t))

    def _flush(self) -> None:
        for w in [w for w in self.windows if w.fields is not None]:
            left = self._unfinished(w)
            if left and not self.final and self.clock() - w.stopped_s < SETTLE_S:
                continue
            self.windows.remove(w)
            w.spans.sort(key=lambda s: s["start_unix_ns"])
            self.write_event(**w.fields, captured_spans=w.spans, spans_unfinished=left)


@dataclass
class _Live:
    """The capture begun: its request, torch.profiler session, last step begun, and its window once recording."""
    request: CaptureRequest
    session: object
    step: int
    begin_seconds: float
    window: Window | None = None
    start_seconds: float = 0.0

    @property
    def end_step(self) -> int:
        return self.request.at_step + self.request.steps


class Captures:
    """The training thread's side: `on_step()` at every `set_step` begins (Kineto's warm-up, a step ahead),
    starts, advances and stops captures; `request()` (the endpoint's thread) arms one; `close()` at the run's
    end stops a live one."""

    def __init__(self, run_dir, rank: int, recorder, spans: CaptureSpans, session_fn, step_fn,
                 schedule=None, clock_ns=time.perf_counter_ns):
        self.run_dir, self.rank, self.recorder, self.spans = Path(run_dir), rank, recorder, spans
        self.session_fn, self.step_fn, self.clock_ns = session_fn, step_fn, clock_ns
        self.schedule = schedule or NullSchedule()
        self._lock = threading.Lock()
        self._pending: CaptureRequest | None = None
        self._live: _Live | None = None

    def request(self, fields: dict) -> dict:
        """The endpoint's `capture` command: {"probe": true} answers the step and whether a capture is armed
        or running; else arm (replacing one not yet begun) at `at_step` for `steps` steps."""
        with self._lock:
            step, live, pending = self.step_fn(), self._live, self._pending
            if fields.get("probe"):
                return {"ok": True, "step": step, "busy": live is not None,
                        "armed": None if pending is None else pending.at_step}
            if live is not None:
                return {"ok": False, "step": step, "error": f"busy: capturing steps {live.request.at_step}-"
                                                            f"{live.end_step - 1} (now at step {step})"}
            try:
                req = parse_request(fields, step)
            except ValueError as exc:
                return {"ok": False, "error": str(exc), "step": step}
            self._pending = req
        return {"ok": True, "step": step, "at_step": req.at_step, "steps": req.steps,
                "file": str(trace_path(self.run_dir, self.rank, req.at_step))}

    def on_step(self, step: int) -> None:
        """At a step boundary on the training thread (Profiler.set_step): a few compares when no capture runs."""
        live = self._live
        if live is None:
            req = self._due(step)
            if req is None:
                return
            live = self._begin(req, step)
            if live is None or step < req.at_step:
                return
        elif step == live.step:
            return
        elif live.step < step < live.end_step:
            live.session.step(step)
            live.step = step
        else:
            self._stop(f"stopped at step {step}")
            if self._due_now(step):   # the next capture may begin (or warm up) at this very boundary
                self.on_step(step)
            return
        if live.window is None:
            self._record(live, step)
        else:
            live.window.marks.append((step, self.clock_ns()))

    def _due_now(self, step: int) -> bool:
        return self._pending is not None or self.schedule.due(step) or self.schedule.due(step + 1)

    def _due(self, step: int):
        """The request to begin at this step: one armed for the next step (or this one), or the schedule's."""
        if self._pending is not None:
            with self._lock:
                req = self._pending
                if req is not None and step + 1 >= req.at_step:
                    self._pending = None
                    if step <= req.at_step:
                        return req
                    self._fail(req, f"step {req.at_step} never began (the loop went on to step {step})")
        for at in (step + 1, step):   # a step ahead, for Kineto's warm-up; at the step itself on a loop's first
            if self.schedule.due(at):
                return CaptureRequest(at, self.schedule.steps, source="schedule")
        return None

    def _begin(self, req: CaptureRequest, step: int):
        t0_s = time.perf_counter()
        try:
            session = self.session_fn(req)
            session.begin(step)
        except Exception as exc:   # noqa: BLE001 - telemetry never kills training
            self._fail(req, f"torch.profiler did not start: {type(exc).__name__}: {exc}")
            return None
        self._live = _Live(req, session, step, time.perf_counter() - t0_s)
        return self._live

    def _record(self, live: _Live, step: int) -> None:
        """Step N began: torch.profiler records now; every span is a record_function range from here on."""
        self.recorder.set_ranges(live.session.ranges)
        t0_ns = self.clock_ns()
        live.window = Window(live.request, t0_ns, marks=[(step, t0_ns)])
        self.spans.windows.append(live.window)

    def _stop(self, why: str) -> None:
        live, self._live = self._live, None
        self.recorder.set_ranges(None)
        t1_ns, t0_s = self.clock_ns(), time.perf_counter()
        req = live.request
        path = trace_path(self.run_dir, self.rank, req.at_step)
        if live.window is None:   # still warming up: nothing recorded
            with contextlib.suppress(Exception):
                live.session.stop(None)
            self._fail(req, why)
            return
        fields = self._fields(req, live.step)
        try:
            saved = live.session.stop(path)
            fields.update(saved, files=[str(path)], bytes_per_step=saved["bytes"] // fields["steps_recorded"])
        except Exception as exc:   # noqa: BLE001
            fields.update(files=[], error=f"torch.profiler did not stop or save: {type(exc).__name__}: {exc}")
        fields.update(begin_seconds=live.begin_seconds, stop_seconds=time.perf_counter() - t0_s, ended=why)
        live.window.t1_ns, live.window.stopped_s = t1_ns, self.spans.clock()
        live.window.fields = fields   # last: the collector writes the event once this is set

    def _fields(self, req: CaptureRequest, last: int) -> dict:
        return {"step": req.at_step, "steps": [req.at_step, last], "steps_recorded": last - req.at_step + 1,
                "steps_asked": req.steps, "source": req.source,
                "options": {"memory": req.memory, "shapes": req.shapes, "stacks": req.stacks}}

    def _fail(self, req: CaptureRequest, why: str) -> None:
        self.spans.write_event(**self._fields(req, req.at_step - 1), files=[], error=why)

    def close(self) -> None:
        """The run ends (training thread): a live capture stops with the steps it ran, an armed one is answered.
        Never raises: the run's own end must still be written."""
        try:
            if self._live is not None:
                self._stop(f"the run ended at step {self.step_fn()}")
            with self._lock:
                req, self._pending = self._pending, None
            if req is not None:
                self._fail(req, f"the run ended at step {self.step_fn()}, before step {req.at_step}")
        except Exception:   # noqa: BLE001
            logger.exception("profiler: closing a capture failed")
        finally:
            self.spans.final = True


class NullCaptures:
    """Stands in before the profiler starts: no capture."""

    def on_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
