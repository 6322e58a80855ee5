"""CUDA span events (profiler/cuda_timing.py), on CPU with fake events on a fake device timeline: each span
records its own start and end, so its GPU window is its own, and an event goes back to the pool only once its
record was resolved."""
from __future__ import annotations

import pytest

import profiler
from profiler.cuda_timing import EventPool
from profiler.faults import InjectedFault
from tests.profiler.build import make_profiler


class Gpu:
    """A fake stream: record() stamps an event with `now_ms`; events up to `done_ms` are complete."""

    def __init__(self):
        self.now_ms, self.done_ms, self.records = 0.0, 1e9, 0


class Event:
    def __init__(self, gpu):
        self.gpu, self.t = gpu, None

    def record(self, stream=None):
        self.t = self.gpu.now_ms
        self.gpu.records += 1

    def query(self):
        return self.t is not None and self.t <= self.gpu.done_ms

    def elapsed_time(self, end):
        assert self.query() and end.query()
        return end.t - self.t


def run(tmp_path, body, faults=""):
    """Run body(gpu) under a profiler with fake events; returns (gpu, pool, spans of the detail window)."""
    gpu = Gpu()
    pool = EventPool(lambda: Event(gpu), prealloc=0)
    with make_profiler(tmp_path, control=False, background=False, measure_floors=False,
                       interval_s=3600.0, event_pool=pool, detail_steps=4, faults=faults) as prof:
        prof.set_step(0)
        body(gpu)
        prof.set_step(1)
        prof.close_interval()
    recs, _ = profiler.read_records(prof.log_path)
    spans = [s for r in recs if r["type"] == "spans" for s in r["spans"]]
    return gpu, pool, spans


def gpu_ms(spans, name):
    return [round(s["gpu_seconds"] * 1e3, 6) for s in spans if s["name"] == name]


def three_stages(gpu):
    for name, ms in (("target.fetch", 1.0), ("target.fwd", 5.0), ("target.pack_hidden", 2.0)):
        with profiler.span(name):
            gpu.now_ms += ms


def test_each_span_records_its_own_start_and_end(tmp_path):
    def with_gaps(gpu):
        for name, ms in (("target.fetch", 1.0), ("target.fwd", 5.0)):
            gpu.now_ms += 3.0           # idle stream time between spans belongs to neither
            with profiler.span(name):
                gpu.now_ms += ms
    gpu, pool, spans = run(tmp_path, with_gaps)
    assert gpu.records == 4
    assert gpu_ms(spans, "target.fetch") == [1.0] and gpu_ms(spans, "target.fwd") == [5.0]
    assert pool.created == 4 and pool.free == 4          # all back once resolved


def test_nested_spans_each_time_their_own_window(tmp_path):
    def nested(gpu):
        with profiler.span("drafter.fwd_bwd"):
            gpu.now_ms += 1.0
            with profiler.span("h2d_copy"):
                gpu.now_ms += 2.0
            with profiler.span("drafter.allreduce"):
                gpu.now_ms += 3.0
            gpu.now_ms += 4.0
        with profiler.span("drafter.optim"):
            gpu.now_ms += 5.0
    gpu, pool, spans = run(tmp_path, nested)
    assert gpu.records == 4 * 2
    assert gpu_ms(spans, "drafter.fwd_bwd") == [10.0] and gpu_ms(spans, "h2d_copy") == [2.0]
    assert gpu_ms(spans, "drafter.allreduce") == [3.0] and gpu_ms(spans, "drafter.optim") == [5.0]
    assert pool.free == pool.created


def test_events_are_reused_only_after_their_record_resolved(tmp_path):
    def many(gpu):
        gpu.done_ms = -1.0                       # nothing completes while the spans run
        for _ in range(50):
            three_stages(gpu)
        prof = profiler.active()
        prof.close_interval()                    # drained and carried, none resolved
        assert prof.event_pool.free == 0
        gpu.done_ms = 1e9
        prof.close_interval()
        for _ in range(50):                      # now the resolved pairs' events serve again
            three_stages(gpu)
    gpu, pool, spans = run(tmp_path, many)
    assert pool.created == 300 and pool.free == 300      # 150 spans, 2 events each, none recycled early


def test_a_cancelled_begin_gives_its_event_back(tmp_path):
    def crashing(gpu):
        with profiler.span("target.fetch"):
            gpu.now_ms += 1.0
        with pytest.raises(InjectedFault):
            with profiler.span("target.fwd"):     # the fault raises after the start was recorded
                gpu.now_ms += 5.0
        with profiler.span("target.fwd"):         # the object stays usable
            gpu.now_ms += 2.0
    gpu, pool, spans = run(tmp_path, crashing, faults="crash@target.fwd:step=0")
    assert gpu_ms(spans, "target.fetch") == [1.0] and gpu_ms(spans, "target.fwd") == [2.0]
    assert pool.free == pool.created
