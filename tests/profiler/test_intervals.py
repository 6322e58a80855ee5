"""Interval boundaries with an injected clock, counters/gauges/metrics, bandwidth vs floors, and the
CUDA pairing logic (carry of unresolved pairs) driven with fake events on CPU."""
import time

import pytest
import torch

import profiler
from profiler.cuda_timing import EventPool, resolve
from profiler.memory import UnavailableMemorySampler, make_memory_sampler
from profiler.spans import SpanRecord
from tests.profiler.build import make_profiler


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def make_prof(tmp_path, clock, **kw):
    kw.setdefault("interval_s", 60.0)
    kw.setdefault("measure_floors", False)
    return make_profiler(tmp_path, control=False, background=False, clock=clock,
                             wall_clock=lambda: 1.7e9, **kw)


def test_boundaries_follow_the_injected_clock_and_straddling_span_counts_where_it_ends(tmp_path):
    # (how its time is split across the two intervals: tests/profiler/test_intervals_split.py)
    clock = FakeClock()
    with make_prof(tmp_path, clock) as prof:
        assert prof.tick() is False                 # before the boundary: poll only
        s = profiler.span("target.fwd")
        s.__enter__()
        clock.t += 60.0
        assert prof.tick() is True                  # boundary passed: interval 0 closes
        first = prof.last_interval
        s.__exit__(None, None, None)                # the span ends in interval 1
        clock.t += 30.0
        assert prof.tick() is False
        clock.t += 30.0
        assert prof.tick() is True
        second = prof.last_interval
    assert first["index"] == 0 and first["duration_seconds"] == 60.0
    assert first["spans"]["target.fwd"]["count"] == 0                     # open: its time, not its count
    assert first["spans"]["target.fwd"]["open_cpu_seconds"] == first["spans"]["target.fwd"]["cpu"]["total_seconds"]
    assert (first["start_s"], first["end_s"]) == (1000.0, 1060.0)
    assert second["index"] == 1 and second["duration_seconds"] == 60.0
    assert second["spans"]["target.fwd"]["count"] == 1
    assert second["type"] == "interval" and second["rank"] == 0 and second["time_unix"] == 1.7e9


def test_missed_boundaries_are_skipped_not_replayed(tmp_path):
    clock = FakeClock()
    with make_prof(tmp_path, clock) as prof:
        clock.t += 250.0                            # a stalled thread: 4 boundaries passed
        assert prof.tick() is True
        assert prof.last_interval["duration_seconds"] == 250.0
        assert prof.tick() is False                 # next boundary is 1300, not 1120
        clock.t = 1299.0
        assert prof.tick() is False
        clock.t = 1300.0
        assert prof.tick() is True


def test_counters_gauges_metrics(tmp_path):
    clock = FakeClock()
    with make_prof(tmp_path, clock) as prof:
        profiler.count("tokens", 100)
        profiler.count("tokens", 20)
        for v in (3, 1, 2):
            profiler.gauge("queue_depth", v)
        profiler.metric("loss", 2.0)
        profiler.metric("loss", torch.tensor(4.0))       # 0-dim tensor, converted at close
        profiler.set_step(7)
        clock.t += 60.0
        prof.tick()
        a = prof.last_interval
        profiler.count("tokens", 30)
        clock.t += 15.0
        b = prof.close_interval()                          # forced close: 15 s interval
    assert a["step"] == 7
    assert a["counters"]["tokens"] == {"total": 120, "per_second": 2.0, "run_total": 120}
    assert a["gauges"]["queue_depth"] == {"last": 2.0, "mean": 2.0, "max": 3.0}
    assert a["metrics"]["loss"] == {"last": 4.0, "mean": 3.0}
    assert b["counters"]["tokens"] == {"total": 30, "per_second": 2.0, "run_total": 150}
    assert b["duration_seconds"] == 15.0 and "queue_depth" not in b["gauges"]


@pytest.mark.parametrize("value, said", [(torch.ones(2), "got 2 elements"), (torch.ones(0), "got 0 elements"),
                                          ("fast", "got 'fast'"), (None, "got None")])
def test_a_value_no_close_can_read_is_refused_at_the_call_and_the_interval_survives(tmp_path, value, said):
    clock = FakeClock()
    with make_prof(tmp_path, clock) as prof:
        profiler.metric("loss", torch.tensor(4.0))
        for call in (profiler.metric, profiler.gauge):
            with pytest.raises(ValueError, match=f"'loss': a number or a one-element tensor, {said}"):
                call("loss", value)
        profiler.gauge("queue_depth", torch.ones(1, 1))   # one element, any shape: kept
        clock.t += 60.0
        assert prof.tick() is True
        a = prof.last_interval
    assert a["metrics"]["loss"] == {"last": 4.0, "mean": 4.0}
    assert a["gauges"]["queue_depth"]["last"] == 1.0


def test_bandwidth_share_and_floor(tmp_path):
    clock = FakeClock()
    floors = {"host_copy": 10e9}
    with make_prof(tmp_path, clock, floors=floors) as prof:
        for _ in range(3):
            with profiler.span("d2h_copy", bytes=1 << 20):
                time.sleep(0.002)
        with profiler.span("target.fwd"):
            pass
        clock.t += 60.0
        rec = prof.close_interval()
    e = rec["spans"]["d2h_copy"]
    assert e["count"] == 3 and e["bytes"] == 3 << 20 and e["gpu"] is None
    assert e["cpu"]["total_seconds"] >= 0.006
    assert e["bandwidth_bytes_per_s"] == pytest.approx(e["bytes"] / e["cpu"]["total_seconds"])
    assert e["floor"] == "host_copy" and e["floor_bytes_per_s"] == 10e9
    assert e["floor_ratio"] == pytest.approx(e["bandwidth_bytes_per_s"] / 10e9)
    assert e["share"] == pytest.approx(e["cpu"]["total_seconds"] / 60.0)
    f = rec["spans"]["target.fwd"]
    assert "bytes" not in f and "floor" not in f and "bandwidth_bytes_per_s" not in f


def test_memory_section_without_nvml_says_why(tmp_path):
    class NoNvml:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    sampler = make_memory_sampler(torch.device("cuda", 0), nvml=NoNvml())
    assert isinstance(sampler, UnavailableMemorySampler)
    clock = FakeClock()
    with make_prof(tmp_path, clock, memory_sampler=sampler) as prof:
        rec = prof.close_interval()
    mem = rec["memory"]
    assert mem["available"] is False and "libnvidia-ml" in mem["reason"]
    assert mem["allocator"]["available"] is False and mem["allocator"]["reason"]

    def numbers(d):
        for v in d.values():
            if isinstance(v, dict):
                yield from numbers(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                yield v
    assert list(numbers(mem)) == []                 # nothing reported as measured
    with make_prof(tmp_path, clock) as prof:         # CPU device: the default sampler
        rec = prof.close_interval()
    assert rec["memory"]["available"] is False and rec["memory"]["reason"] == "no CUDA device"


# ---- CUDA pairing logic with fake events ------------------------------------------------------
class FakeGpu:
    """A fake device timeline: record() stamps an event with `now_ms`; an event is complete once
    `done_ms` has reached its stamp."""
    def __init__(self):
        self.now_ms, self.done_ms, self.calls = 0.0, -1.0, []


class FakeEvent:
    def __init__(self, gpu):
        self.gpu, self.t = gpu, None

    def record(self, stream=None):
        self.t = self.gpu.now_ms
        self.gpu.calls.append("record")

    def query(self):
        self.gpu.calls.append("query")
        return self.t is not None and self.t <= self.gpu.done_ms

    def elapsed_time(self, end):
        self.gpu.calls.append("elapsed_time")
        assert self.query() and end.query(), "elapsed_time called before both events completed"
        return end.t - self.t


def test_cuda_pairs_resolve_in_order_and_unresolved_are_carried(tmp_path):
    gpu = FakeGpu()
    pool = EventPool(lambda: FakeEvent(gpu), prealloc=2)
    clock = FakeClock()
    with make_prof(tmp_path, clock, event_pool=pool) as prof:
        for length_ms in (5.0, 7.0):
            with profiler.span("target.fwd"):
                gpu.now_ms += length_ms               # the kernel this span enqueued
                time.sleep(length_ms / 1e3)           # ... runs meanwhile (the share's cap is host time)
        gpu.done_ms = 5.0                             # only the first pair has completed
        clock.t += 60.0
        first = prof.close_interval()
        gpu.done_ms = 12.0
        clock.t += 60.0
        second = prof.close_interval()
    a, b = first["spans"]["target.fwd"], second["spans"]["target.fwd"]
    assert a["count"] == 1 and a["gpu"]["total_seconds"] == pytest.approx(0.005)
    assert b["count"] == 1 and b["gpu"]["total_seconds"] == pytest.approx(0.007)
    assert a["share"] == pytest.approx(0.005 / 60.0)     # GPU time when available
    # Grown once; all returned, the last end event (the thread's tail's) when the run ended.
    assert pool.created == 4 and pool.free == 4
    assert set(gpu.calls) <= {"record", "query", "elapsed_time"}


def test_cuda_pairs_still_pending_at_run_end_are_reported_cpu_only(tmp_path):
    gpu = FakeGpu()
    pool = EventPool(lambda: FakeEvent(gpu), prealloc=0)
    clock = FakeClock()
    with make_prof(tmp_path, clock, event_pool=pool, gpu_drain_timeout_s=0.05) as prof:
        with profiler.span("drafter.fwd_bwd"):
            gpu.now_ms += 3.0                       # never completes
    log, _ = profiler.read_records(prof.log_path)
    final = [r for r in log if r["type"] == "interval"][-1]
    e = final["spans"]["drafter.fwd_bwd"]
    assert e["count"] == 1 and e["gpu"] is None and e["gpu_unresolved"] == 1


def test_resolve_keeps_order():
    gpu = FakeGpu()
    pool = EventPool(lambda: FakeEvent(gpu), prealloc=0)
    recs = []
    for i in range(4):
        s, e = pool.take(), pool.take()
        s.record()
        gpu.now_ms += 1
        e.record()
        recs.append(SpanRecord.of("x", 0, 1, 0, None, i, None, None, s, e))
    gpu.done_ms = 2.0
    done, still = resolve([("t", r) for r in recs], pool)
    assert [r for _, r, _ in done] == recs[:2] and still == [("t", r) for r in recs[2:]]
    assert [g for _, _, g in done] == [0.001, 0.001] and {t for t, _, _ in done} == {"t"}
    assert pool.free == 4                        # the two resolved records' events, back in one call


def test_an_intervals_values_convert_in_one_pass_in_order():
    from profiler.intervals import to_floats_by_name

    w = torch.tensor(2.0, requires_grad=True)
    gauges = {"queue_depth": [3, torch.tensor(1, dtype=torch.int64)]}
    metrics = {"loss": [torch.tensor(0.5, dtype=torch.bfloat16), w * 3, 1.25], "acc": [torch.tensor([0.75])],
               "lr": [0.001]}
    g, m = to_floats_by_name(gauges, metrics)
    assert g == {"queue_depth": [3.0, 1.0]}
    assert m == {"loss": [0.5, 6.0, 1.25], "acc": [0.75], "lr": [0.001]}
    assert to_floats_by_name({}, {"x": [1, 2]}) == [{}, {"x": [1.0, 2.0]}]
    # one-element 1-d tensors stack to (2, 1): read through the reshaping path
    assert to_floats_by_name({"y": [torch.tensor([1.5]), torch.tensor([2.5])]}) == [{"y": [1.5, 2.5]}]
