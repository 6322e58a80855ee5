"""The detail window: raw spans of a few steps per interval, for the `spans` record (traces, OTel spans).

The choice is made on the training thread at `profiler.set_step` (StepMarks.mark: a few attribute reads, one
list append at a window's edge), so `profiler.in_detail()` answers at once. A producer (a target) opens a
window of `steps` steps at the first step after an interval opens that is a multiple of `align` (1 until an
interval ran 2 x align steps, so short runs keep their first steps) and marks the batches it makes in it; a
follower (a drafter) keeps the steps its caller marks with `profiler.keep_step()`, so both hold the same
batches. A window step keeps every span that *begins* while it runs; a span tagged `detail=...` is kept
exactly when the tag is true (a send of a batch from before the window must not be kept: its receive is not).
The collector (DetailWindow) matches finished spans against the last MAX_RANGES window steps' time ranges,
so a span lands in the record of the interval in which it finishes, up to `max_spans` (the rest `dropped`).
"""
from __future__ import annotations

from bisect import bisect_right

MAX_DETAIL_SPANS = 20000
DETAIL_ALIGN = 8      # a producer's windows start on a multiple of this step
MAX_RANGES = 512      # window steps whose time ranges are remembered: a span begun in an older one is not kept


class StepMarks:
    """The training thread's side: `mark()` at each `set_step`, `keep_step()`, `in_window`. Window steps' time
    ranges go to `edges` (perf_counter_ns, open and close in turn: an odd length means the last is open), their
    steps to `range_steps`; the collector (DetailWindow) reads and trims both."""

    def __init__(self):
        self.steps, self.follows = 0, False   # set by DetailWindow
        self.edges: list = []
        self.range_steps: list = []
        self.opened = 0          # intervals opened so far: bumped by the collector (DetailWindow.take)
        self.step_of = 1         # a producer's window starts on a multiple of this (set by the collector)
        self.changes = 0         # step changes so far (the collector reads how many an interval ran)
        self.last_step = None
        self.in_window = False   # the current step is a window step
        self._t0_ns = 0          # when the current step began
        self._left = 0           # window steps still to run, the current one included
        self._armed = -1         # the `opened` count the producer last started a window for

    def mark(self, t_ns: int, step: int) -> None:
        """A step change at t_ns: close the window when its steps have run; a producer opens one at the first
        aligned step after an interval opened."""
        if step == self.last_step:
            return
        self.last_step, self._t0_ns = step, t_ns
        self.changes += 1
        if self.in_window:   # the step that ends closes its range; a window step still to run opens its own
            self.in_window = False
            self.edges.append(t_ns)
            if self._left > 1:
                self._open(t_ns, step, self._left - 1)
        if (not self.in_window and not self.follows and self.steps and self._armed != self.opened
                and step % self.step_of == 0):
            self._armed = self.opened
            self._open(t_ns, step, self.steps)

    def keep_step(self) -> None:
        """Keep the current step, from its `set_step` on (a follower's only way to choose one)."""
        if self.steps and not self.in_window and self.last_step is not None:
            self._open(self._t0_ns, self.last_step, 1)

    def _open(self, t_ns: int, step: int, steps: int) -> None:
        self._left, self.in_window = steps, True
        self.range_steps.append(step)   # before the edge: a reader that sees the range finds its step
        self.edges.append(t_ns)


class DetailWindow:
    """The collector's side: `offer()` keeps the finished spans the window holds, `take()` returns the `spans`
    record's fields and starts the next. It sets the rule its `marks` follow."""

    def __init__(self, steps: int, marks: StepMarks, to_unix_ns, native_ids: dict,
                 max_spans: int = MAX_DETAIL_SPANS, follows: bool = False):
        marks.steps, marks.follows = steps, follows
        self.marks, self.to_unix_ns, self.native_ids, self.max_spans = marks, to_unix_ns, native_ids, max_spans
        self._changes = 0   # marks.changes at the last take
        self._start_record()

    def _start_record(self) -> None:
        self.spans: list = []
        self.dropped = 0
        self.first = self.last = None   # the window steps the record's spans began in

    def _range_step(self, t_ns: int):
        """The window step whose time range holds t_ns, or None."""
        edges = self.marks.edges
        if not edges or t_ns < edges[0]:
            return None
        i = bisect_right(edges, t_ns)
        return self.marks.range_steps[i // 2] if i % 2 else None

    def offer(self, done) -> None:
        """Keep each finished span, (thread_name, SpanRecord, gpu_seconds or None), that the window holds."""
        for thread_name, rec, gpu_s in done:
            attrs = rec.attrs
            tagged = attrs.get("detail") if attrs else None
            if tagged is None:
                step = self._range_step(rec.t0_ns)
                if step is None:
                    continue
                self.first = step if self.first is None else min(self.first, step)
                self.last = step if self.last is None else max(self.last, step)
            elif not tagged:
                continue
            if len(self.spans) >= self.max_spans:
                self.dropped += 1
                continue
            entry = {"id": rec.id, "parent": rec.parent, "name": rec.name, "thread": thread_name,
                     "tid": self.native_ids.get(thread_name), "depth": rec.depth,
                     "start_unix_ns": self.to_unix_ns(rec.t0_ns), "end_unix_ns": self.to_unix_ns(rec.t1_ns),
                     "cpu_seconds": (rec.t1_ns - rec.t0_ns) / 1e9, "gpu_seconds": gpu_s, "bytes": rec.bytes}
            if attrs:
                entry["attrs"] = attrs
            self.spans.append(entry)

    def take(self) -> dict | None:
        """The `spans` fields of the spans kept since the last take (None when none); tells the training thread
        an interval opened, so its next aligned step starts a window."""
        out = None
        if self.spans or self.dropped:
            self.spans.sort(key=lambda s: s["start_unix_ns"])
            steps = None if self.first is None else [self.first, self.last]
            out = {"steps": steps, "spans": self.spans, "dropped": self.dropped}
        marks = self.marks
        changes = marks.changes
        ran, self._changes = changes - self._changes, changes
        marks.step_of = DETAIL_ALIGN if ran >= 2 * DETAIL_ALIGN else 1
        marks.opened += 1
        extra = len(marks.range_steps) - MAX_RANGES
        if extra > 0:   # the training thread only appends: deleting a prefix keeps edges and steps paired
            del marks.edges[:2 * extra]
            del marks.range_steps[:extra]
        self._start_record()
        return out


class NullDetailWindow:
    """Stands in when no detail window is wanted (detail_steps=0)."""

    def offer(self, done) -> None:
        pass

    def take(self) -> None:
        return None
