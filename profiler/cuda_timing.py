"""CUDA event timing for spans: a pool of reused events, and the collector-side resolver.

Each CUDA span records its own start and end event on the current stream, so its GPU window is its own.
Host-device syncs: none. Events are created, recorded (an asynchronous enqueue) and, on the collector, read
with `elapsed_time()` only once `query()` said both are done. A span records through the C `record` on a
cached Stream object looked up by the current stream's raw handle: the public `Event.record()` builds a
Stream object in Python on every call.
"""
from __future__ import annotations


class EventPool:
    """Timing events reused across spans: workers take them with a list pop, the collector gives resolved
    ones back with `put()` (a list extend), both atomic, so no lock. With an `event_factory` (tests) events
    are the factory's, recorded with `ev.record(stream)` on a constant stream 0."""

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

    def take(self):
        """An event from the free list, or a new one when it is empty."""
        try:
            return self.free_list.pop()
        except IndexError:
            self.created += 1
            return self._factory()

    def stream_for(self, raw):
        """The Stream object of the current stream whose raw handle is `raw` (cached)."""
        stream = self.streams.get(raw)
        if stream is None:
            stream = self.streams[raw] = self._current_stream()
        return stream

    def current(self):
        """The calling thread's current Stream object, cached by raw handle (non-finite checks queue on it)."""
        return self.stream_for(self.getraw(self.device_index))

    def put(self, *events) -> None:
        """Give events back once nothing reads them (resolved, or taken and never recorded)."""
        self.free_list.extend(events)

    @property
    def free(self) -> int:
        return len(self.free_list)


def _stream_functions(event_factory, device_index):
    """(getraw(index) -> the current stream's handle as an int, index, record(ev, stream), current_stream())
    for real CUDA events, trivial ones for a test factory."""
    if event_factory is not None:
        return (lambda idx: 0), 0, (lambda ev, stream: ev.record(stream)), (lambda: None)
    import torch

    idx = torch.cuda.current_device() if device_index is None else device_index
    record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None) or torch.cuda.Event.record
    return torch._C._cuda_getCurrentRawStream, idx, record, (lambda: torch.cuda.current_stream(idx))


def resolve(pending: list, pool: EventPool, place=None):
    """(thread_name, SpanRecord) pairs in -> (resolved: (thread_name, record, gpu_seconds) of the records whose
    events both completed, their events back in the pool; still_pending: the rest, in order). `place(name,
    record)` (profiler/gpu_lag.py) sees each resolved record while its events are still its own."""
    resolved, still, freed = [], [], []
    for item in pending:
        thread_name, rec = item
        start, end = rec.start_event, rec.end_event
        ms = elapsed_ms(start, end)
        if ms is not None:
            if place is not None:
                place(rec.name, rec)
            resolved.append((thread_name, rec, ms / 1000.0))   # ms -> seconds
            freed += (start, end)
        else:
            still.append(item)
    if freed:
        pool.put(*freed)
    return resolved, still


def elapsed_ms(start, end) -> float | None:
    """Milliseconds between two recorded events, None while either is not done (query() never waits)."""
    if end.query() and start.query():
        return start.elapsed_time(end)
    return None
