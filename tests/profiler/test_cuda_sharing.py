"""Shared boundary events between adjacent CUDA spans (profiler/cuda_timing.py), on CPU with fake
events on a fake device timeline: fewer records, the same GPU times, and an event goes back to the
pool only once every record using it was resolved."""
from __future__ import annotations

import pytest

import profiler
from profiler import spans as spans_mod
from profiler.cuda_timing import EventPool
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


def run(tmp_path, body, gap_ns=10**12, streams=None, faults=""):
    """Run body(gpu) under a profiler with fake events; returns (gpu, pool, spans of the detail window)."""
    gpu = Gpu()
    pool = EventPool(lambda: Event(gpu), prealloc=0)
    if streams is not None:
        pool.getraw = lambda idx: streams[0]
    old, spans_mod.SHARE_GAP_NS = spans_mod.SHARE_GAP_NS, gap_ns
    try:
        with make_profiler(tmp_path, control=False, background=False, measure_floors=False,
                               interval_s=3600.0, event_pool=pool, detail_steps=4, faults=faults) as prof:
            prof.set_step(0)
            body(gpu)
            prof.set_step(1)
            prof.close_interval()
    finally:
        spans_mod.SHARE_GAP_NS = old
    recs, _ = profiler.read_records(prof.log_path)
    spans = [s for r in recs if r["type"] == "spans" for s in r["spans"]]
    return gpu, pool, spans


def gpu_ms(spans, name):
    return [round(s["gpu_seconds"] * 1e3, 6) for s in spans if s["name"] == name]


def three_stages(gpu):
    for name, ms in (("target.fetch", 1.0), ("target.fwd", 5.0), ("target.pack_hidden", 2.0)):
        with profiler.span(name):
            gpu.now_ms += ms


def test_adjacent_spans_share_boundaries_and_keep_their_gpu_times(tmp_path):
    gpu, pool, spans = run(tmp_path, three_stages)
    assert gpu.records == 4      # start, then one end per span: 3 spans, 4 records instead of 6
    assert [gpu_ms(spans, n) for n in ("target.fetch", "target.fwd", "target.pack_hidden")] == [[1.0], [5.0], [2.0]]
    assert pool.created == 4 and pool.free == 4          # all back, the tail's last end at run end


def test_a_pause_longer_than_the_gap_or_another_stream_records_its_own_start(tmp_path):
    gpu, _, spans = run(tmp_path, three_stages, gap_ns=-1)
    assert gpu.records == 6 and gpu_ms(spans, "target.fwd") == [5.0]
    streams = [1]

    def switching(gpu):
        with profiler.span("target.fetch"):
            gpu.now_ms += 1.0
        streams[0] = 2          # the next span runs on another stream
        with profiler.span("target.fwd"):
            gpu.now_ms += 5.0
    gpu, _, spans = run(tmp_path / "b", switching, streams=streams)
    assert gpu.records == 4 and gpu_ms(spans, "target.fwd") == [5.0]


def test_nested_spans_share_only_with_the_sibling_that_just_ended(tmp_path):
    def nested(gpu):
        with profiler.span("drafter.fwd_bwd"):
            gpu.now_ms += 1.0
            with profiler.span("h2d_copy"):
                gpu.now_ms += 2.0
            with profiler.span("drafter.allreduce"):      # shares h2d_copy's end
                gpu.now_ms += 3.0
            gpu.now_ms += 4.0
        with profiler.span("drafter.optim"):              # shares drafter.fwd_bwd's end
            gpu.now_ms += 5.0
    gpu, pool, spans = run(tmp_path, nested)
    assert gpu.records == 2 + 2 + 1 + 1
    assert gpu_ms(spans, "drafter.fwd_bwd") == [10.0] and gpu_ms(spans, "h2d_copy") == [2.0]
    assert gpu_ms(spans, "drafter.allreduce") == [3.0] and gpu_ms(spans, "drafter.optim") == [5.0]
    assert pool.free == pool.created                # the tail's hold too, at run end


def test_events_are_reused_only_after_every_record_using_them_resolved(tmp_path):
    def many(gpu):
        gpu.done_ms = -1.0                       # nothing completes while the spans run
        for _ in range(50):
            three_stages(gpu)
        prof = profiler.active()
        prof.close_interval()                    # drained and carried, none resolved
        assert pool_of(prof).free == 0
        gpu.done_ms = 1e9
        prof.close_interval()
    gpu, pool, spans = run(tmp_path, many)
    assert pool.created == 151 and pool.free == 151      # 150 spans: 1 start + 150 ends, none recycled early


def pool_of(prof):
    return prof.event_pool


def test_a_cancelled_shared_begin_keeps_the_previous_record_intact(tmp_path):

    def crashing(gpu):
        with profiler.span("target.fetch"):
            gpu.now_ms += 1.0
        with pytest.raises(Exception):
            with profiler.span("target.fwd"):     # shares target.fetch's end, then the fault raises
                gpu.now_ms += 5.0
    gpu, pool, spans = run(tmp_path, crashing, faults="crash@target.fwd:step=0")
    assert gpu_ms(spans, "target.fetch") == [1.0] and gpu_ms(spans, "target.fwd") == []
    assert pool.free == pool.created      # the cancelled begin took the tail's hold over and gave it back
