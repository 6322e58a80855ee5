"""The collector's side of CUDA event timing against fake events: a pair resolves only once both of its events
completed (Event.query(): never a wait), and resolution keeps order and gives back only resolved pairs' events.
Real events: tests/profiler/test_cuda.py."""
from profiler.cuda_timing import EventPool, elapsed_ms, resolve
from profiler.spans import SpanRecord


class Event:
    """A recorded event at `t_ms` on a fake GPU that has run up to `done_ms`."""

    def __init__(self, t_ms, done_ms=100.0):
        self.t_ms, self.done_ms, self.elapsed_calls = t_ms, done_ms, 0

    def query(self) -> bool:
        return self.t_ms <= self.done_ms

    def elapsed_time(self, end) -> float:
        assert self.query() and end.query(), "elapsed_time on a pending event would wait"
        self.elapsed_calls += 1
        return end.t_ms - self.t_ms


def test_elapsed_is_none_while_either_event_is_pending_and_never_asks_then():
    assert elapsed_ms(Event(2), Event(10)) == 8.0
    pending_end, pending_start = Event(2), Event(200)
    assert elapsed_ms(pending_end, Event(150)) is None and pending_end.elapsed_calls == 0
    assert elapsed_ms(pending_start, Event(20)) is None and pending_start.elapsed_calls == 0


def test_resolve_keeps_order_and_releases_only_resolved_pairs():
    pool = EventPool(event_factory=lambda: Event(0), prealloc=0)
    a, b, c, d = Event(0), Event(2), Event(3), Event(160)
    rec = lambda s, e: SpanRecord.of("x", 0, 1, start_event=s, end_event=e)   # noqa: E731
    pending = [("t", rec(a, b)), ("t", rec(c, d)), ("u", rec(b, c))]
    done, still = resolve(pending, pool)
    assert [(n, sec) for n, _, sec in done] == [("t", 0.002), ("u", 0.001)]
    assert still == [pending[1]] and pool.free_list == [a, b, b, c]
