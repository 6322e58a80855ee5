"""CUDA event timing for spans: a pool of reused events, and the collector-side resolver.

Each CUDA span records its own start and end event on the current stream, so its GPU window (from when the
stream reached the start event to when it reached the end event) is its own: no idle time moves in from the
span before it.

Host-device syncs: NONE. The only CUDA calls here are creating `torch.cuda.Event(enable_timing=True)`,
recording one (an asynchronous enqueue, in the span hot path), and on the collector `Event.query()` on both
events of a pair, then `elapsed_time()` once both said done (so it never waits). No synchronize(),
Event.synchronize(), Event.wait() or .item().

Hot path: the public `Event.record()` looks the current stream up in Python on every call (it builds a
Stream object); a span instead reads the current stream's raw handle, maps it to a cached Stream object, and
calls the C record directly.
"""
from __future__ import annotations


class EventPool:
    """Timing events reused across spans. Workers take events with a list pop and the collector gives
    resolved ones back with `put()` (a list extend): both atomic, so no lock.

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

    def take(self):
        """An event from the free list, or a new one when it is empty (the collector returns events once
        resolved)."""
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
        """The calling thread's current Stream object, through the raw handle (torch.cuda.current_stream() would
        build a new object); what a non-finite check queues its flags with."""
        return self.stream_for(self.getraw(self.device_index))

    def put(self, *events) -> None:
        """Give events back once nothing reads them (resolved, or taken and never recorded)."""
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
    events both completed (their events go back to the pool, in one call); the rest are kept, in order,
    for a later call (carried into the next interval)."""
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
        pool.put(*freed)
    return resolved, still


def elapsed_ms(start, end) -> float | None:
    """Milliseconds between two recorded events, None while either is not done. Event.query() never waits, and
    elapsed_time() is asked only once both events completed: no host-device sync."""
    if end.query() and start.query():
        return start.elapsed_time(end)
    return None
