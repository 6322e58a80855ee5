"""What the GPU did in a CUDA span, always on: launch-bound, GPU-bound or mixed, from where its two events lie on
the host's timeline. No capture and no host-device sync.

A span's events give its GPU *window* (the stream reached the start event .. reached the end event, idle time
included). To place them on the host timeline, the collector records an *anchor* event on a private stream that
nothing else uses, so the GPU reaches it one launch latency after the host's record call; once `query()` says it
is done, any completed event E of the device sits at `anchor_host_ns + anchor.elapsed_time(E)` (elapsed_time works
across the streams of one device). A span's start event then lies `start lag` after the host's begin (t0) and its
end event `end lag` after the host's end (t1). The anchor's own launch latency is in every placement, so a lag
reads ~0 when the span's stream was idle (an event recorded on an idle stream runs one launch latency later,
like the anchor).

Per span (a *sample*), with tolerance T (LAUNCH_SLACK_S plus the anchors' placement error, below):
- *launch-bound*: the stream was idle when the span began (start lag <= max(T, HOST_PACED_SHARE of its window))
  and its GPU work ended within max(T, HOST_PACED_SHARE of its window) of the host's end: the host's launches
  paced the GPU and the window is host time;
- *GPU-bound*: the GPU was still working through the span's queue after the host had finished it for at least
  GPU_BOUND_TAIL_SHARE of its window (that tail is queued work, so busy);
- *mixed*: the rest.
A span whose host waits for the GPU at its end (a sync) also ends with end lag ~0: it reads launch-bound when
its stream was idle at its start; the interval's GPM SM activity (profiler/memory.py), shown beside the class,
tells a busy GPU. The anchors' placement error: between consecutive anchors, |GPU gap - host gap| is the
difference of their launch latencies; its p90 over the kept anchors widens T.

Off the hot path: `tick()` (every collector poll) records at most one anchor and resolves the last one with
`query()`; `place()` runs in the resolver, on pairs whose events are done, before they go back to the pool;
`take()` gives each span name's `gpu_lag` entry for the interval record and starts the next interval.
"""
from __future__ import annotations

import bisect
import time
from collections import deque

from profiler.schema.gpu_classes import CLASS_SHARE_MIN, GPU, LAUNCH, MIXED, class_of  # noqa: F401

LAUNCH_SLACK_S = 50e-6
"""A launch latency (~5-10 us on H100/H200) plus a small last kernel: a GPU that ends this soon after the host
kept pace with it."""
HOST_PACED_SHARE = 0.2
"""... or within this share of the span's window: the window is at least 80% host time (wide enough for a last
kernel of a few ms, or a time slice of another process sharing the GPU, on a window of tens of ms)."""
GPU_BOUND_TAIL_SHARE = 0.5
"""A span whose GPU work runs on after the host's end for at least this share of its window is GPU-bound."""
ANCHOR_CALL_MAX_NS = 200_000
"""An anchor whose record call took longer (the host thread was descheduled) is dropped: its host time is unsure."""
ANCHOR_BEFORE_NS = 1_000_000
"""A span is placed against the latest anchor recorded at least this long before its begin (a positive gap)."""
KEEP_ANCHORS = 512


class NullGpuLag:
    """No CUDA, or a test without it: nothing placed, no entries."""

    def tick(self) -> None:
        pass

    def place(self, name: str, rec) -> None:
        pass

    def take(self) -> dict:
        return {}


class GpuLag:
    """Anchors and per-span samples (module doc). `event_factory()` makes a timing event, `record(event, stream)`
    enqueues it on `stream` (the private one), `clock_ns()` is the span clock (perf_counter_ns)."""

    def __init__(self, event_factory, record, stream, clock_ns=time.perf_counter_ns, keep: int = KEEP_ANCHORS):
        self._factory, self._record, self._stream, self._clock_ns = event_factory, record, stream, clock_ns
        self.pending = None                         # (host ns, event): the anchor not yet done
        self.anchors_ns: deque = deque(maxlen=keep)  # host ns of done anchors, ascending
        self.anchors: deque = deque(maxlen=keep)     # their events
        self.errors_s: deque = deque(maxlen=keep)    # |GPU gap - host gap| between consecutive anchors
        self.samples: dict = {}                     # span name -> [(start lag s, end lag s, window s)]
        self.unplaced: dict = {}                    # span name -> spans with no anchor before them

    def tick(self) -> None:
        """Resolve the pending anchor (query(), never a wait); record a new one when none is pending."""
        if self.pending is not None:
            host_ns, ev = self.pending
            if not ev.query():
                return
            self.pending = None
            if self.anchors:
                gap_s = self.anchors[-1].elapsed_time(ev) / 1e3 - (host_ns - self.anchors_ns[-1]) / 1e9
                self.errors_s.append(abs(gap_s))
            self.anchors_ns.append(host_ns)
            self.anchors.append(ev)
        ev = self._factory()
        before_ns = self._clock_ns()
        self._record(ev, self._stream)
        after_ns = self._clock_ns()
        if after_ns - before_ns <= ANCHOR_CALL_MAX_NS:
            self.pending = (after_ns, ev)   # after the call, as a span's t0 follows its start record

    def place(self, name: str, rec) -> None:
        """A finished CUDA SpanRecord (profiler/spans.py), both events done: its lags."""
        i = bisect.bisect_right(self.anchors_ns, rec.t0_ns - ANCHOR_BEFORE_NS) - 1
        if i < 0:
            self.unplaced[name] = self.unplaced.get(name, 0) + 1
            return
        anchor_ns, anchor = self.anchors_ns[i], self.anchors[i]
        try:
            start_ns = anchor_ns + anchor.elapsed_time(rec.start_event) * 1e6   # ms -> ns
            end_ns = anchor_ns + anchor.elapsed_time(rec.end_event) * 1e6
        except RuntimeError:   # an event the driver will not time against the anchor: counted, never raised
            self.unplaced[name] = self.unplaced.get(name, 0) + 1
            return
        self.samples.setdefault(name, []).append(((start_ns - rec.t0_ns) / 1e9, (end_ns - rec.t1_ns) / 1e9,
                                                  (end_ns - start_ns) / 1e9))

    def tolerance_s(self) -> float:
        """LAUNCH_SLACK_S plus the p90 placement error of the kept anchors."""
        errors = sorted(self.errors_s)
        return LAUNCH_SLACK_S + (errors[int(0.9 * (len(errors) - 1))] if errors else 0.0)

    def take(self) -> dict:
        """{span name: its `gpu_lag` entry} for the interval's samples; the next interval starts empty."""
        tol_s = self.tolerance_s()
        out = {name: lag_entry(s, tol_s, self.unplaced.get(name, 0)) for name, s in self.samples.items()}
        for name, n in self.unplaced.items():
            out.setdefault(name, {"n": 0, "unplaced": n, "tolerance_s": tol_s})
        self.samples, self.unplaced = {}, {}
        return out


def sample_class(start_lag_s: float, end_lag_s: float, window_s: float, tol_s: float) -> str:
    """One span's class from its lags (module doc)."""
    slack_s = max(tol_s, HOST_PACED_SHARE * window_s)
    if start_lag_s <= slack_s and end_lag_s <= slack_s:
        return LAUNCH
    if window_s > 0 and end_lag_s >= GPU_BOUND_TAIL_SHARE * window_s:
        return GPU
    return MIXED


def lag_entry(samples: list, tol_s: float, unplaced: int = 0) -> dict:
    """An interval's `gpu_lag` entry for one span name from its (start lag, end lag, window) samples."""
    classes = [sample_class(s, e, w, tol_s) for s, e, w in samples]
    n = len(samples)
    window_s = sum(w for _, _, w in samples)
    tail_s = sum(min(max(0.0, e), w) for _, e, w in samples if w > 0)
    return {"n": n, "launch_bound": classes.count(LAUNCH), "gpu_bound": classes.count(GPU),
            "start_lag_p50_s": _median([s for s, _, _ in samples]),
            "end_lag_p50_s": _median([e for _, e, _ in samples]),
            "window_seconds": window_s, "tail_seconds": tail_s, "tolerance_s": tol_s, "unplaced": unplaced}


def _median(values: list):
    if not values:
        return None
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def make_gpu_lag(device_index: int):
    """GpuLag on a private stream of the CUDA device `device_index` (torch imported here only)."""
    import torch

    stream = torch.cuda.Stream(device=device_index)
    return GpuLag(lambda: torch.cuda.Event(enable_timing=True), lambda ev, s: ev.record(s), stream)
