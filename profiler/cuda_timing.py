"""CUDA event timing for spans: a reused event pool with shared boundary events, and the
collector-side resolver.

Host-device syncs: NONE. The only CUDA calls here are creating `torch.cuda.Event(enable_timing=True)`,
recording one (an asynchronous enqueue, in the span hot path), and on the collector `Event.query()` on both
events of a pair, then `elapsed_time()` once both said done (so it never waits). No synchronize(),
Event.synchronize(), Event.wait() or .item().

Hot path: the public `Event.record()` looks the current stream up in Python on every call (it builds a
Stream object); a span instead reads the current stream's raw handle, maps it to a cached Stream object, and
calls the C record directly.

Sharing: adjacent spans on one thread and stream share a boundary event: a span that begins within
`SHARE_GAP_NS` of the previous span's end, on the same stream, with nothing begun in between, takes
that end event as its start (one record instead of two). GPU work launched in that gap (at most
a few microseconds of host time) counts toward the later span. An event can then belong to two
records, so the pool counts references (collector side only) and takes an event back when the last
record using it was resolved, and when the thread's "last end" no longer points at it.
"""
from __future__ import annotations

import threading

SHARE_GAP_NS = 50_000
"""A span that begins more than this after the previous one ended records its own start event, so
a host-side pause between two spans never counts as GPU time of the second."""


class EventPool:
    """Timing events reused across spans. Workers take events with `take()` (a list pop: atomic);
    the collector hands references out and back with `adjust()`/`release()` under a lock.

    `event_factory` makes an event (default: a timing `torch.cuda.Event`); with a factory (tests),
    `record_fn(ev, stream)` defaults to `ev.record(stream)` and streams are a constant 0."""

    def __init__(self, event_factory=None, prealloc: int = 64, device_index: int | None = None):
        self.getraw, self.device_index, self.record, self._current_stream = _stream_functions(
            event_factory, device_index)
        if event_factory is None:
            import torch
            event_factory = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._factory = event_factory
        self.free_list = [event_factory() for _ in range(prealloc)]
        self.created = prealloc
        self.streams: dict = {}             # raw stream handle -> Stream object to record on
        self._refs: dict = {}               # id(event) -> references held by records and tails
        self._lock = threading.Lock()

    def grow(self):
        """A new event, when the free list is empty (the collector returns events once resolved)."""
        self.created += 1
        return self._factory()

    def get(self):
        """An event from the free list (or a new one)."""
        try:
            return self.free_list.pop()
        except IndexError:
            return self.grow()

    def stream_for(self, raw):
        """The Stream object of the current stream whose raw handle is `raw` (cached)."""
        stream = self.streams.get(raw)
        if stream is None:
            stream = self.streams[raw] = self._current_stream()
        return stream

    def current(self):
        """The calling thread's current Stream object, through the raw handle (torch.cuda.current_stream() would
        build a new object); what a non-finite check queues its flags with."""
        raw = self.getraw(self.device_index)
        return self.streams.get(raw) or self.stream_for(raw)

    def release(self, *events) -> None:
        """Collector side: one holder of each event is done; an event nobody holds is free again."""
        refs, free = self._refs, self.free_list
        with self._lock:
            for ev in events:
                key = id(ev)
                left = refs.pop(key, 1) - 1    # absent: its one record held it
                if left > 0:
                    refs[key] = left
                else:
                    free.append(ev)

    def adjust(self, retained, released) -> None:
        """Collector side, one replay's changes in one call: a holder more for each event in `retained`,
        then one fewer for each in `released` (an event freed here cannot have been taken again and
        retained in the same replay, so applying the retains first gives the same counts as in order)."""
        refs = self._refs
        with self._lock:
            for ev in retained:
                refs[id(ev)] = refs.get(id(ev), 1) + 1   # absent: its one record holds it
        if released:
            self.release(*released)

    def put(self, *events) -> None:
        """Give events nobody holds back (e.g. taken and never recorded)."""
        self.free_list.extend(events)

    @property
    def free(self) -> int:
        return len(self.free_list)


def _stream_functions(event_factory, device_index):
    """(getraw(index), index, record(ev, stream), current_stream()) for real CUDA events, or trivial
    ones for a test factory. The record bypasses torch.cuda.Event.record's per-call Python stream
    lookup; `getraw` is the C call that returns the current stream's handle as an int."""
    if event_factory is not None:
        return (lambda idx: 0), 0, (lambda ev, stream: ev.record(stream)), (lambda: None)
    import torch

    idx = torch.cuda.current_device() if device_index is None else device_index
    record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None) or torch.cuda.Event.record
    return torch._C._cuda_getCurrentRawStream, idx, record, (lambda: torch.cuda.current_stream(idx))


def resolve(pending: list, pool: EventPool):
    """Resolve CUDA span records in order. `pending` holds (thread_name, record) pairs. Returns
    (resolved, still_pending): `resolved` holds (thread_name, record, gpu_seconds) for records whose
    events both completed (the records' holds on their events are released, in one call); the rest are
    kept, in order, for a later call (carried into the next interval)."""
    if not pending:
        return [], []
    resolved, still, freed = [], [], []
    for item in pending:
        rec = item[1]
        start, end = rec[8], rec[9]
        ms = elapsed_ms(start, end)
        if ms is not None:
            resolved.append((item[0], rec, ms / 1000.0))   # ms -> seconds
            freed += (start, end)
        else:
            still.append(item)
    if freed:
        pool.release(*freed)
    return resolved, still


def elapsed_ms(start, end) -> float | None:
    """Milliseconds between two recorded events, None while either is not done. Event.query() never waits, and
    elapsed_time() is asked only once both events completed: no host-device sync."""
    if end.query() and start.query():
        return start.elapsed_time(end)
    return None
