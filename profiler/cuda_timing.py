"""CUDA event timing for spans: a reused event pool and the collector-side resolver.

Host-device syncs: NONE. The only CUDA calls here are `torch.cuda.Event(enable_timing=True)`
(construction), `Event.record()` (enqueue, in the span hot path), `Event.query()` (non-blocking
status check) and `Event.elapsed_time()` — called only after both events' query() returned True,
so it never waits. No synchronize(), Event.synchronize(), Event.wait() or .item() anywhere.
"""
from __future__ import annotations


class EventPool:
    """Timing events reused across spans. `get()` runs on worker threads, `put()` on the collector;
    list.pop()/list.extend() are atomic, so no lock is needed."""

    def __init__(self, event_factory=None, prealloc: int = 64):
        if event_factory is None:
            import torch
            event_factory = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._factory = event_factory
        self._free = [event_factory() for _ in range(prealloc)]
        self.created = prealloc

    def get(self):
        try:
            return self._free.pop()
        except IndexError:      # pool empty: grow (the collector returns events once resolved)
            self.created += 1
            return self._factory()

    def put(self, *events) -> None:
        self._free.extend(events)

    @property
    def free(self) -> int:
        return len(self._free)


def resolve(pending: list, pool: EventPool):
    """Resolve CUDA span records in order. Returns (resolved, still_pending): `resolved` holds
    `(record, gpu_seconds)` for records whose events both completed (their events go back to the
    pool); the rest are kept, in order, for a later call (carried into the next interval)."""
    resolved, still = [], []
    for rec in pending:
        start, end = rec[8], rec[9]
        # query() never blocks; elapsed_time() is only called once both events are done.
        if end.query() and start.query():
            resolved.append((rec, start.elapsed_time(end) / 1000.0))   # ms -> seconds
            pool.put(start, end)
        else:
            still.append(rec)
    return resolved, still
