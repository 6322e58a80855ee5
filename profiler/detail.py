"""The detail window: raw spans of the first few steps of each interval, for the `spans` record.

Intervals keep aggregates only; traces and OTel spans need the spans themselves (start, end, thread,
parent). Keeping every span of a long run would be unbounded, so each interval keeps those that
*begin* during its first `steps` steps (a step begins at `profiler.set_step`), on any thread, up to
`max_spans`; the rest are counted in `dropped`. All of it runs on the collector side: the hot path
only pays for `set_step` appending one `(t_ns, step)` mark.

Windows start on a step that is a multiple of `align` when the previous interval ran at least
2 x align steps, so ranks whose steps count the same batches (a target and the drafter it feeds, which
runs a few batches behind) keep the same batches: the trace can draw a batch from send to receive.
"""
from __future__ import annotations

MAX_DETAIL_SPANS = 20000
DETAIL_ALIGN = 8
"""Windows start on a multiple of this step (module doc)."""


class StepMarks:
    """`(perf_counter_ns, step)` of each step change, appended by the training thread."""

    def __init__(self):
        self.marks: list = []
        self.last_step = None

    def mark(self, t_ns: int, step: int) -> None:
        if step != self.last_step:
            self.last_step = step
            self.marks.append((t_ns, step))

    def trim_before(self, t_ns: int) -> None:
        """Forget marks older than t_ns (the collector calls this when a new window starts)."""
        n = 0
        marks = self.marks
        while n < len(marks) - 1 and marks[n][0] < t_ns:
            n += 1
        if n:
            del marks[:n]


class DetailWindow:
    """Collects the window's spans as the aggregator finishes them; `take()` returns the record's
    fields and opens the next window at the given time."""

    def __init__(self, steps: int, marks: StepMarks, to_unix_ns, native_ids: dict,
                 max_spans: int = MAX_DETAIL_SPANS, align: int = DETAIL_ALIGN):
        self.steps, self.marks, self.to_unix_ns = steps, marks, to_unix_ns
        self.native_ids, self.max_spans, self.align = native_ids, max_spans, align
        self._step_of = 1
        self._open(0)

    def _open(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.lo = self.hi = None      # (t_ns, step) of the window's first step and of the step after it
        self.spans: list = []
        self.dropped = 0

    def _bounds(self) -> None:
        marks = self.marks.marks
        if self.lo is None:
            for i, (t, step) in enumerate(marks):
                if t >= self.start_ns and step % self._step_of == 0:
                    self.lo, self._lo_index = (t, step), i
                    break
        if self.lo is not None and self.hi is None and len(marks) > self._lo_index + self.steps:
            self.hi = marks[self._lo_index + self.steps]

    def offer(self, done) -> None:
        """Keep each finished span, (thread_name, record, gpu_seconds or None), that began inside the window."""
        if self.hi is None:
            self._bounds()
        if self.lo is None:
            return
        lo, hi = self.lo[0], self.hi[0] if self.hi is not None else None
        for thread_name, rec, gpu_s in done:
            if rec[1] < lo or (hi is not None and rec[1] >= hi):
                continue
            if len(self.spans) >= self.max_spans:
                self.dropped += 1
                continue
            entry = {"id": rec[5], "parent": rec[6], "name": rec[0], "thread": thread_name,
                     "tid": self.native_ids.get(thread_name), "depth": rec[3],
                     "start_unix_ns": self.to_unix_ns(rec[1]), "end_unix_ns": self.to_unix_ns(rec[2]),
                     "cpu_seconds": (rec[2] - rec[1]) / 1e9, "gpu_seconds": gpu_s, "bytes": rec[4]}
            if rec[7]:
                entry["attrs"] = rec[7]
            self.spans.append(entry)

    def take(self, next_start_ns: int) -> dict | None:
        """The finished window's `spans` fields (None when it kept nothing); opens the next one."""
        out = None
        if self.spans or self.dropped:
            last = self.hi[1] - 1 if self.hi is not None else self.marks.last_step
            self.spans.sort(key=lambda s: s["start_unix_ns"])
            out = {"steps": [self.lo[1] if self.lo else None, last], "spans": self.spans, "dropped": self.dropped}
        ran = sum(1 for t, _ in self.marks.marks if self.start_ns <= t < next_start_ns)
        self._step_of = self.align if ran >= 2 * self.align else 1
        self.marks.trim_before(next_start_ns)
        self._open(next_start_ns)
        return out


class NullDetailWindow:
    """Stands in when no detail window is wanted (detail_steps=0)."""

    def offer(self, done) -> None:
        pass

    def take(self, next_start_ns: int) -> None:
        return None
