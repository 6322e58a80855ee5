"""CUDA event timing on a real GPU (skipped without one).

No-sync argument, by inspection (profiler/cuda_timing.py, profiler/spans.py, profiler/core.py): the
span hot path only calls Event.record(); the collector calls Event.query() on both events of a pair and
elapsed_time() only once both are done (profiler/cuda_timing.py elapsed_ms); run end polls that with a sleep.
Nothing calls torch.cuda.synchronize(), Event.synchronize(), Event.wait(), Stream.synchronize() or .item().
set_sync_debug_mode("error") below checks the calls it can see.
"""
import logging
import time

import pytest
import torch

import profiler
from tests.profiler.build import make_profiler

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def make_prof(tmp_path, **kw):
    dev = torch.device("cuda", torch.cuda.current_device())
    kw.setdefault("interval_s", 3600.0)
    kw.setdefault("background", False)
    return make_profiler(tmp_path, device=dev, control=False, floors={}, **kw)


def _warm_up():
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()      # the test's own sync, before any profiler exists


def test_a_pair_resolves_only_once_both_events_are_done_and_then_agrees_with_torch():
    from profiler.cuda_timing import elapsed_ms

    _warm_up()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    assert elapsed_ms(start, end) is None                  # still running: "not ready", no wait
    end.synchronize()                                      # the test's own sync
    ms = elapsed_ms(start, end)
    assert ms == pytest.approx(start.elapsed_time(end), abs=1e-3)
    assert ms > 1.0
    side = torch.cuda.Stream()                             # now only the start is pending, behind a side stream
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()                                      # the test's own sync: the end is done
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        start.record()
    t0 = time.perf_counter()
    assert end.query() and not start.query()
    assert elapsed_ms(start, end) is None
    assert time.perf_counter() - t0 < 0.005                # answered at once, not after the sleep
    side.synchronize()                                     # the test's own sync, before the events go


def test_gpu_times_match_reference_events(tmp_path):
    _warm_up()
    cycles = [200_000, 2_000_000, 20_000_000]
    refs = []
    with make_prof(tmp_path) as prof:
        # Keep the GPU busy while the spans are enqueued, so every event runs back to back on the
        # GPU: otherwise the span's start event also times the CPU gap (~10 us per record) before
        # the reference event that follows it.
        torch.cuda._sleep(50_000_000)
        for i, c in enumerate(cycles):
            with profiler.span(f"k.sleep{i}"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(c)
                b.record()
            refs.append((a, b))
        torch.cuda.synchronize()  # test-side: make every pair resolvable at this close
        rec = prof.close_interval()
    for i, (a, b) in enumerate(refs):
        ref_s = a.elapsed_time(b) / 1000.0
        e = rec["spans"][f"k.sleep{i}"]
        got = e["gpu"]["total_seconds"]
        assert abs(got - ref_s) <= 0.05 * ref_s + 20e-6, (i, got, ref_s)
        assert e["share"] == pytest.approx(got / rec["duration_seconds"])


def test_gpu_time_covers_kernel_when_cpu_part_is_short(tmp_path):
    _warm_up()
    with make_prof(tmp_path) as prof:
        with profiler.span("k.long"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(40_000_000)          # ~20 ms of GPU time, microseconds to enqueue
            b.record()
        torch.cuda.synchronize()
        rec = prof.close_interval()
    e = rec["spans"]["k.long"]
    ref_s = a.elapsed_time(b) / 1000.0
    assert ref_s > 0.005
    assert e["cpu"]["total_seconds"] < 0.5 * ref_s
    assert e["gpu"]["total_seconds"] >= ref_s


def test_whole_flow_without_host_sync(tmp_path, caplog):
    _warm_up()
    x = torch.randn(1024, 1024, device="cuda")
    caplog.set_level(logging.WARNING, logger="profiler")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with make_prof(tmp_path, interval_s=0.05, poll_s=0.01, background=True) as prof:
            for i in range(200):
                with profiler.span("a.outer"):
                    with profiler.span("a.mm"):
                        y = x @ x
                    with profiler.span("d2d_copy", bytes=y.numel() * y.element_size() * 2):
                        x.copy_(y)
                profiler.count("tokens", 10)
                profiler.gauge("queue_depth", i % 4)
                profiler.metric("loss", 1.0)
                profiler.set_step(i)
                if i % 50 == 0:
                    time.sleep(0.06)               # let the collector close intervals meanwhile
            prof.close_interval()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    recs, bad = profiler.read_records(prof.log_path)
    end = recs[-1]
    assert bad == 0 and end["type"] == "run_end" and end["status"] == "ok"
    assert end["spans"]["a.mm"]["count"] == 200
    assert end["spans"]["a.mm"]["gpu"]["total_seconds"] > 0
    assert sum(r["type"] == "interval" for r in recs) >= 3
    assert prof.event_pool.free == prof.event_pool.created    # every event went back to the pool


def test_cuda_tensor_metric_converted_at_close(tmp_path):
    _warm_up()
    with make_prof(tmp_path) as prof:
        for v in (1.0, 2.0, 6.0):
            profiler.metric("loss", torch.tensor(v, device="cuda"))
        rec = prof.close_interval()
    assert rec["metrics"]["loss"] == {"last": 6.0, "mean": 3.0}
    assert rec["memory"]["allocator"]["available"] is True


def test_every_step_times_the_gpu(tmp_path):
    """Every CUDA span records events on every step: each span carries a GPU time in proportion to its
    kernels, and every event came back."""
    _warm_up()
    records = []
    with make_prof(tmp_path, detail_steps=0) as prof:
        pool = prof.event_pool
        record = pool.record       # the spans take it when first made, below
        pool.record = lambda ev, stream: (records.append(ev), record(ev, stream))
        for step in range(6):
            prof.set_step(step)
            with profiler.span("k.sleep"):
                torch.cuda._sleep(2_000_000)
            with profiler.span("k.after"):
                torch.cuda._sleep(200_000)
        torch.cuda.synchronize()  # test-side: make every pair resolvable at this close
        rec = prof.close_interval()
    e, after = rec["spans"]["k.sleep"], rec["spans"]["k.after"]
    assert (e["count"], e["gpu_count"], after["count"], after["gpu_count"]) == (6, 6, 6, 6)
    assert e["gpu"]["p50_seconds"] > 5 * after["gpu"]["p50_seconds"] > 0
    assert "gpu_unresolved" not in e
    assert len(records) == 6 * 2 * 2   # a start and an end per span
    assert pool.free == pool.created
