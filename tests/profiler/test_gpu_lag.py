"""The always-on GPU classification (profiler/gpu_lag.py) with fake events: each event is recorded at a GPU time
the test chooses, the anchor too, so the lags and classes are known exactly."""
import pytest

from profiler.cuda_timing import EventPool
from profiler.gpu_lag import GPU, LAUNCH, LAUNCH_SLACK_S, MIXED, GpuLag, lag_entry, sample_class
from profiler.intervals import IntervalAggregator
from profiler.spans import SpanRecord
from profiler.schema.windows import gpu_bound

US, MS = 1_000, 1_000_000          # ns
GPU_OFFSET_NS = 987_654_321_000    # the GPU clock's zero is not the host's


class FakeEvent:
    """A timing event done at GPU time `t_ns` (GPU clock); `done` says whether query() reports it complete."""

    def __init__(self, t_ns=None, done=True):
        self.t_ns, self.done = t_ns, done

    def query(self):
        return self.done

    def elapsed_time(self, other):
        return (other.t_ns - self.t_ns) / 1e6   # ms, as torch.cuda.Event.elapsed_time


class Clock:
    def __init__(self, ns):
        self.ns = ns

    def __call__(self):
        return self.ns


def make_lag(host_ns=10 * MS, anchor_latency_ns=5 * US):
    """A GpuLag whose first anchor is recorded at host `host_ns` and reached by the GPU `anchor_latency_ns` later."""
    clock = Clock(host_ns)
    made = []

    def record(ev, stream):
        assert stream == "private"
        ev.t_ns = GPU_OFFSET_NS + clock.ns + anchor_latency_ns
        made.append(ev)

    lag = GpuLag(FakeEvent, record, "private", clock_ns=clock)
    lag.tick()                       # records the anchor
    clock.ns += 100 * MS
    lag.tick()                       # resolves it (query() True) and records the next
    return lag, clock, made


def cuda_record(name, t0_ns, t1_ns, gpu_start_ns, gpu_end_ns):
    """A finished CUDA record as profiler/spans.py drains it, its events done at the given host-timeline times
    (the GPU clock is the host's plus GPU_OFFSET_NS, and an event reached on an idle stream shows the anchor's
    latency, so these are the lags that should be read)."""
    lat = 5 * US
    return SpanRecord.of(name, t0_ns, t1_ns, 0, None, 1, None, None,
                         FakeEvent(GPU_OFFSET_NS + gpu_start_ns + lat), FakeEvent(GPU_OFFSET_NS + gpu_end_ns + lat))


def test_the_anchor_places_events_on_the_host_timeline_and_its_latency_cancels():
    lag, clock, _ = make_lag()
    t0 = 200 * MS
    lag.place("a", cuda_record("a", t0, t0 + 20 * MS, t0 + 3 * US, t0 + 20 * MS + 7 * US))
    (s, e, w), = lag.samples["a"]
    assert s == pytest.approx(3e-6, abs=1e-9) and e == pytest.approx(7e-6, abs=1e-9)
    assert w == pytest.approx(0.020004, abs=1e-9)


def test_a_span_beginning_before_any_anchor_is_counted_unplaced():
    lag, _, _ = make_lag(host_ns=500 * MS)
    lag.place("early", cuda_record("early", 100 * MS, 110 * MS, 100 * MS, 110 * MS))
    assert "early" not in lag.samples
    assert lag.take()["early"] == {"n": 0, "unplaced": 1, "tolerance_s": LAUNCH_SLACK_S}


def test_classes_of_host_paced_gpu_bound_and_mixed_spans():
    tol = LAUNCH_SLACK_S
    # ~200 tiny kernels: the GPU keeps pace, its last kernel ends 8 us after the host's last launch
    assert sample_class(4e-6, 8e-6, 0.020, tol) == LAUNCH
    # a launch-bound span whose last kernel takes 3 ms of a 20 ms window: still host-paced (<= 20 % of it)
    assert sample_class(4e-6, 3e-3, 0.020, tol) == LAUNCH
    # matmuls queued without a sync: the host is done in 1 ms, the GPU 40 ms later
    assert sample_class(4e-6, 0.039, 0.040, tol) == GPU
    # a span that began behind earlier GPU work (start lag 15 ms) and caught up: not host-paced all along
    assert sample_class(0.015, 5e-6, 0.020, tol) == MIXED
    # the GPU ends 6 ms after the host in a 20 ms window: 30 % tail, neither
    assert sample_class(4e-6, 0.006, 0.020, tol) == MIXED


def test_the_interval_entry_counts_classes_and_medians_and_the_accessor_calls_the_span():
    samples = [(4e-6, 8e-6, 0.02)] * 5 + [(4e-6, 0.039, 0.04)]
    entry = lag_entry(samples, LAUNCH_SLACK_S)
    assert (entry["n"], entry["launch_bound"], entry["gpu_bound"]) == (6, 5, 1)
    assert entry["end_lag_p50_s"] == pytest.approx(8e-6)
    assert entry["tail_seconds"] == pytest.approx(5 * 8e-6 + 0.039)
    got = gpu_bound([{"gpu_lag": entry}, {"gpu_lag": entry}, {"cpu": {}}], sm_active_percent=6.0)
    assert got["class"] == LAUNCH and got["samples"] == 12 and got["intervals"] == 2
    assert got["busy_share"] == pytest.approx(0.06) and got["busy_source"] == "GPM SM active"
    assert gpu_bound([{"gpu_lag": entry}], capture_busy_share=0.05, sm_active_percent=60.0)["busy_source"] == "capture"
    half = lag_entry([(4e-6, 8e-6, 0.02), (4e-6, 0.039, 0.04)], LAUNCH_SLACK_S)
    assert gpu_bound([{"gpu_lag": half}])["class"] == MIXED
    assert gpu_bound([{"cpu": {}}]) is None


def test_the_anchors_placement_error_widens_the_tolerance():
    lag, clock, made = make_lag()
    for jitter_us in (0, 40, 0, 40, 0):        # launch latencies alternating 5 us and 45 us
        made[-1].t_ns += jitter_us * US
        clock.ns += 100 * MS
        lag.tick()
    assert lag.tolerance_s() == pytest.approx(LAUNCH_SLACK_S + 40e-6, abs=1e-9)


def test_a_pending_anchor_is_not_used_and_a_slow_record_call_drops_it():
    clock = Clock(10 * MS)

    def slow_record(ev, stream):
        ev.t_ns = GPU_OFFSET_NS + clock.ns
        clock.ns += 1 * MS                      # the host was descheduled inside the call

    lag = GpuLag(lambda: FakeEvent(done=False), slow_record, "private", clock_ns=clock)
    lag.tick()
    assert lag.pending is None and not lag.anchors
    lag = GpuLag(lambda: FakeEvent(done=False), lambda ev, s: setattr(ev, "t_ns", GPU_OFFSET_NS + clock.ns), "p",
                 clock_ns=clock)
    lag.tick()
    lag.tick()                                  # still not done: kept pending, no new one
    assert lag.pending is not None and not lag.anchors


def test_the_aggregator_puts_each_span_entrys_gpu_lag_into_the_interval():
    lag, clock, _ = make_lag()
    pool = EventPool(event_factory=FakeEvent, prealloc=0)
    agg = IntervalAggregator(is_cuda=True, event_pool=pool, gpu_lag=lag)
    t0 = 300 * MS
    launch = cuda_record("drafter.fwd_bwd", t0, t0 + 20 * MS, t0 + 2 * US, t0 + 20 * MS + 9 * US)
    gpu = cuda_record("target.fwd", t0 + 30 * MS, t0 + 31 * MS, t0 + 30 * MS, t0 + 80 * MS)
    agg.add_drained([("w", [launch, gpu], [])])
    spans = agg.close_parts(1.0)["spans"]
    assert spans["drafter.fwd_bwd"]["gpu_lag"]["launch_bound"] == 1
    assert spans["target.fwd"]["gpu_lag"]["gpu_bound"] == 1
    assert gpu_bound([spans["drafter.fwd_bwd"]])["class"] == LAUNCH
    assert gpu_bound([spans["target.fwd"]])["class"] == GPU
    assert "gpu_lag" not in agg.close_parts(1.0)["spans"].get("target.fwd", {})   # the next interval starts empty


def test_the_profiler_writes_each_cuda_spans_gpu_lag_into_its_interval_record(tmp_path):
    """Through the real recorder, collector and run log, with events stamped on the host clock plus a chosen GPU
    delay: a span whose GPU ends with the host is launch-bound, one whose GPU ends 50 ms later GPU-bound."""
    import time

    import profiler
    from tests.profiler.build import make_profiler

    delay_ms = {"now": 0.0}

    class HostEvent(FakeEvent):
        def record(self, stream=None):
            self.t_ns = GPU_OFFSET_NS + time.perf_counter_ns() + int(delay_ms["now"] * 1e6)

    pool = EventPool(HostEvent, prealloc=0)
    lag = GpuLag(HostEvent, lambda ev, s: ev.record(s), None)
    with make_profiler(tmp_path, control=False, background=False, measure_floors=False, interval_s=3600.0,
                       event_pool=pool, gpu_lag=lag) as prof:
        prof.collector.poll()          # the first anchor
        time.sleep(0.002)
        prof.collector.poll()          # resolved
        time.sleep(0.002)
        for _ in range(3):
            with profiler.span("k.tiny"):
                time.sleep(0.005)      # the host launching; the GPU keeps pace
            with profiler.span("k.matmul"):
                delay_ms["now"] = 0.0
                time.sleep(0.001)
                delay_ms["now"] = 50.0  # the end event: the GPU reaches it 50 ms after the host's end
            delay_ms["now"] = 0.0
        prof.close_interval()
    recs, _ = profiler.read_records(prof.log_path)
    spans = next(r for r in recs if r["type"] == "interval")["spans"]
    assert spans["k.tiny"]["gpu_lag"]["launch_bound"] == 3 and spans["k.tiny"]["gpu_lag"]["n"] == 3
    assert spans["k.matmul"]["gpu_lag"]["gpu_bound"] == 3
    assert spans["k.matmul"]["gpu_lag"]["end_lag_p50_s"] == pytest.approx(0.050, abs=0.002)
