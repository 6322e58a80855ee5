"""The Prometheus exporter on its own: what a scrape says after given records (histograms cumulative
across intervals, shares of absent spans back to 0, counters from run totals, event kinds present at
0), promtool's verdict on it, and the port rules (loopback by default, a busy requested port refused,
a busy default port falling back)."""
import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

from exporters.prometheus import MetricsPortInUse, PrometheusExporter

BOUNDS = [0.01, 0.1, 1.0]


def interval(spans, tokens_run_total, role="drafter", **extra):
    return {"type": "interval", "time_unix": time.time(), "role": role, "step": 5, "spans": spans,
            "counters": {"tokens": {"total": 10, "per_second": 5.0, "run_total": tokens_run_total}}, **extra}


def tick(time_unix, t_s, counters, spans=None):
    return {"type": "tick", "time_unix": time_unix, "role": "drafter", "index": 0, "t_s": t_s, "step": 5,
            "counters": counters, "spans": spans or {}}


def span(share, buckets, total):
    """An interval's span entry whose spans all ended in it: their whole time is the time inside it."""
    return {"share": share, "count": sum(buckets),
            "cpu": {"total_seconds": total, "mean_seconds": total / max(1, sum(buckets)), "buckets": buckets},
            "gpu": None}


@pytest.fixture
def exporter():
    e = PrometheusExporter({"rank": 3, "role": "drafter", "host": "h1"}, port=0)
    e.export({"type": "run_start", "time_unix": time.time(), "histogram_buckets_seconds": BOUNDS, "schema": 1,
              "t_s": 10.0})
    yield e
    e.close(1.0)


def scrape(e) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=5).read().decode()


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels without rank/role/host): value}, via prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            assert {smp.labels[k] for k in ("rank", "role", "host")} == {"3", "drafter", "h1"}
            labels = {k: v for k, v in smp.labels.items() if k not in ("rank", "role", "host")}
            out[(smp.name, frozenset(labels.items()))] = smp.value
    return out


def test_histograms_accumulate_and_absent_spans_lose_their_share(exporter):
    exporter.export(interval({"drafter.recv": span(0.5, [1, 2, 0, 0], 0.2),
                              "drafter.fwd_bwd": span(0.4, [0, 0, 3, 1], 3.0)}, 100))
    exporter.export(interval({"drafter.fwd_bwd": span(0.9, [0, 1, 1, 0], 0.5)}, 250, profiler_share=0.004))
    exporter.export(tick(time.time(), 12.0, {"tokens": 250}))
    got = samples(scrape(exporter))
    assert got[("dflash_profiler_cpu_ratio", frozenset())] == 0.004
    fwd = {"clock": "cpu", "span": "drafter.fwd_bwd"}
    for le, cumulative in (("0.01", 0), ("0.1", 1), ("1.0", 5), ("+Inf", 6)):
        assert got[("dflash_span_seconds_bucket", frozenset({**fwd, "le": le}.items()))] == cumulative
    assert got[("dflash_span_seconds_count", frozenset(fwd.items()))] == 6
    assert got[("dflash_span_seconds_sum", frozenset(fwd.items()))] == pytest.approx(3.5)
    share = lambda name: got[("dflash_span_share_ratio", frozenset({"span": name}.items()))]   # noqa: E731
    assert share("drafter.recv") == 0.0 and share("drafter.fwd_bwd") == 0.9   # recv finished nothing
    assert got[("dflash_wait_ratio", frozenset({"span": "drafter.recv"}.items()))] == 0.0
    assert got[("dflash_tokens_total", frozenset())] == 250
    assert got[("dflash_events_total", frozenset({"kind": "oom"}.items()))] == 0


def test_live_scrape_passes_promtool(exporter):
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (scripts/test.sh installs Debian's prometheus package)")
    exporter.export(interval({"transfer.send": {**span(0.1, [1, 0, 0, 0], 0.001), "bytes": 10,
                                                "bandwidth_bytes_per_s": 1e4, "floor": "host_copy",
                                                "floor_bytes_per_s": 1e9, "floor_ratio": 1e-5}}, 5, role="target",
                             memory={"available": True, "gpus": [{"index": 0, "total_bytes": 100, "used_bytes_last": 40,
                                                                  "used_bytes_peak": 60, "headroom_bytes": 40,
                                                                  "throttle_reasons": ["sw_power_cap"]}]}))
    exporter.export({"type": "event", "kind": "nonfinite", "time_unix": time.time()})
    r = subprocess.run(["promtool", "check", "metrics"], input=scrape(exporter), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_endpoint_binds_loopback_only(exporter):
    with socket.socket() as s:
        s.connect(("127.0.0.1", exporter.port))
    assert exporter._server.server_address[0] == "127.0.0.1"


def test_busy_port_refused_when_requested_and_replaced_when_default():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MetricsPortInUse, match=f"port {port} on 127.0.0.1 is in use"):
            PrometheusExporter({"rank": 0, "role": "r", "host": "h"}, port=port, strict=True)
        e = PrometheusExporter({"rank": 0, "role": "r", "host": "h"}, port=port, strict=False)
        try:
            assert e.port != port and "dflash_events_total" in scrape(e)
        finally:
            e.close(1.0)


def test_idle_connections_are_bounded_and_timed_out_and_scrapes_come_back(monkeypatch):
    """Another local user's idle connections (issue 34 row 9): at most MAX_CONNECTIONS handler threads, each
    closed after READ_TIMEOUT_S without a request, and then the endpoint serves scrapes again."""
    import threading

    from exporters import prometheus
    monkeypatch.setattr(prometheus, "READ_TIMEOUT_S", 0.5)
    exp = PrometheusExporter({"rank": 0, "role": "drafter", "host": "h"}, port=0)
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(60)]
        time.sleep(0.3)
        assert threading.active_count() - before <= prometheus.MAX_CONNECTIONS
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before   # every idle one timed out and its thread ended
        body = urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=5).read().decode()
        assert "dflash_" in body
        for s in idle:
            s.close()
    finally:
        exp.close(1.0)


def test_process_series_carry_the_rank_labels_and_threads_are_counted(exporter):
    got = samples(scrape(exporter))   # samples() asserts rank/role/host on every sample, process_* included
    assert got[("process_cpu_seconds_total", frozenset())] > 0
    assert got[("process_resident_memory_bytes", frozenset())] > 1 << 20
    assert got[("dflash_process_threads", frozenset())] >= 2   # this one and the endpoint's


def test_gpu_series_carry_the_uuid_and_gpm_activity_as_ratios(exporter):
    uuid = "GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12"
    gpu = {"index": 0, "uuid": uuid, "total_bytes": 100, "used_bytes_last": 40, "used_bytes_peak": 60,
           "headroom_bytes": 40, "util_percent_mean": 100.0, "sm_active_percent_mean": 35.0,
           "tensor_active_percent_mean": 4.0, "sm_occupancy_percent_mean": None, "dram_active_percent_mean": 12.5}
    exporter.export(interval({}, 5, memory={"available": True, "gpus": [gpu], "allocator": {
        "available": True, "allocated_bytes": 7, "num_ooms": 0}}))
    got = samples(scrape(exporter))
    labels = frozenset({"gpu": "0", "UUID": uuid}.items())
    assert got[("dflash_gpu_utilization_ratio", labels)] == 1.0
    assert got[("dflash_gpu_sm_active_ratio", labels)] == 0.35
    assert got[("dflash_gpu_tensor_active_ratio", labels)] == 0.04
    assert got[("dflash_gpu_dram_active_ratio", labels)] == 0.125
    assert ("dflash_gpu_sm_occupancy_ratio", labels) not in got          # null in the run log: no series, never 0
    assert got[("dflash_allocator_allocated_bytes", labels)] == 7
    assert got[("dflash_gpu_memory_headroom_min_ratio", labels)] == 0.4


def test_profiled_seconds_profiler_and_thread_cpu_accumulate_and_run_end_carries_the_status(exporter):
    for share in (0.01, 0.03):
        exporter.export(interval({}, 5, duration_seconds=2.0, profiler_share=share,
                                 threads_cpu_seconds={"drafter.main": 1.5, "profiler.collector": 0.01}))
    exporter.export(tick(time.time(), 14.0, {}))   # the fixture's run_start began the segment at t_s 10.0
    exporter.export({"type": "run_end", "time_unix": 1234.5, "status": "hang"})
    got = samples(scrape(exporter))
    assert got[("dflash_profiled_seconds_total", frozenset())] == 4.0
    assert got[("dflash_profiler_cpu_seconds_total", frozenset())] == pytest.approx(0.08)
    assert got[("dflash_thread_cpu_seconds_total", frozenset({"thread": "drafter.main"}.items()))] == 3.0
    assert got[("dflash_run_end_timestamp_seconds", frozenset({"status": "hang"}.items()))] == 1234.5
    exporter.export({"type": "run_start", "time_unix": time.time(), "histogram_buckets_seconds": BOUNDS})
    assert not any(name == "dflash_run_end_timestamp_seconds" for name, _ in samples(scrape(exporter)))   # resumed


def test_close_waits_for_a_scrape_of_the_last_records_only_where_something_scrapes():
    """Never scraped: close() returns at once. Scraped before: it returns once a scrape that read the last record
    has been answered (here one a second later), within its timeout; keep_serving leaves the endpoint up."""
    quiet = PrometheusExporter({"rank": 0, "role": "drafter", "host": "h"}, port=0, keep_serving=True)
    quiet.export({"type": "event", "kind": "hang", "time_unix": time.time()})
    t = time.monotonic()
    quiet.close(5.0)
    assert time.monotonic() - t < 0.5
    quiet.shutdown()

    watched = PrometheusExporter({"rank": 0, "role": "drafter", "host": "h"}, port=0, keep_serving=True)
    try:
        scrape(watched)
        watched.export({"type": "event", "kind": "hang", "time_unix": time.time()})
        got = []
        timer = threading.Timer(1.0, lambda: got.append(scrape(watched)))
        timer.start()
        t = time.monotonic()
        watched.close(5.0)
        waited = time.monotonic() - t
        timer.join()
        assert 0.8 < waited < 4.0 and 'dflash_events_total{host="h",kind="hang",rank="0",role="drafter"} 1.0' in got[0]
        assert 'kind="hang"' in scrape(watched)   # still serving after close
        watched.export({"type": "event", "kind": "oom", "time_unix": time.time()})
        t = time.monotonic()
        watched.close(0.3)                        # nothing scrapes now: gives up at its timeout
        assert 0.25 < time.monotonic() - t < 1.5
    finally:
        watched.shutdown()


def test_every_label_is_defaulted_the_host_from_the_machine():
    """Issue 37: PrometheusExporter raised KeyError: 'host' unless given one; each common label now has a default."""
    e = PrometheusExporter(port=0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=5).read().decode()
        assert f'dflash_profile_intervals_total{{host="{socket.gethostname()}",rank="0",role="main"}} 0.0' in text
    finally:
        e.close(0.0)
    e = PrometheusExporter({"role": "trainer"}, port=0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=5).read().decode()
        assert f'host="{socket.gethostname()}",rank="0",role="trainer"' in text
    finally:
        e.close(0.0)


def exposition_lines(text: str, name: str) -> list:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_counters_exist_at_zero_and_move_with_every_tick_stamped_with_its_time():
    """Before anything: tokens, samples, steps and profiled seconds at 0, stamped (never newer than a tick folded
    later). Each tick sets the run totals and the span counters with the tick's time as the sample's timestamp."""
    e = PrometheusExporter({"rank": 3, "role": "drafter", "host": "h1"}, port=0)
    try:
        before = time.time()
        first = scrape(e)
        for name in ("dflash_tokens_total", "dflash_samples_total", "dflash_steps_total",
                     "dflash_profiled_seconds_total"):
            (line,) = exposition_lines(first, name)
            value, stamp_ms = line.split()[-2:]
            assert float(value) == 0.0 and int(stamp_ms) <= before * 1000 + 1
        e.export({"type": "run_start", "time_unix": 1.7e9, "histogram_buckets_seconds": BOUNDS, "t_s": 100.0})
        spans = {"drafter.fwd_bwd": {"count": 3, "cpu_seconds": 2.5, "self_seconds": 2.0, "gpu_seconds": 2.25,
                                     "gpu_self_seconds": 1.75, "gpu_count": 2},
                 "drafter.compile": {"count": 0, "cpu_seconds": 7.5, "self_seconds": 7.5}}
        e.export(tick(1.7e9 + 12.5, 112.5, {"tokens": 4096, "steps": 4}, spans))
        text = scrape(e)
    finally:
        e.close(0.1)
    got = samples(text)
    stamp = str(int((1.7e9 + 12.5) * 1000))
    for name in ("dflash_tokens_total", "dflash_steps_total", "dflash_profiled_seconds_total",
                 "dflash_span_time_seconds_total", "dflash_span_self_time_seconds_total", "dflash_spans_total"):
        assert all(line.endswith(" " + stamp) for line in exposition_lines(text, name)), name
    assert got[("dflash_tokens_total", frozenset())] == 4096 and got[("dflash_steps_total", frozenset())] == 4
    assert got[("dflash_profiled_seconds_total", frozenset())] == 12.5
    fwd = lambda clock: frozenset({"span": "drafter.fwd_bwd", "clock": clock}.items())   # noqa: E731
    assert got[("dflash_span_time_seconds_total", fwd("cpu"))] == 2.5
    assert got[("dflash_span_time_seconds_total", fwd("gpu"))] == 2.25
    assert got[("dflash_span_self_time_seconds_total", fwd("gpu"))] == 1.75
    assert (got[("dflash_spans_total", fwd("cpu"))], got[("dflash_spans_total", fwd("gpu"))]) == (3, 2)
    compile_gpu = frozenset({"span": "drafter.compile", "clock": "gpu"}.items())
    assert ("dflash_span_time_seconds_total", compile_gpu) not in got      # no CUDA pair timed: no GPU series


def test_the_exact_p95_is_a_gauge_kept_from_the_last_interval_the_span_ended_any_stamped_with_its_end(exporter):
    """The dashboard's exact p95 (the run log's figure), not histogram_quantile's bucket estimate. An interval in
    which the span ended none (the run's last ones: evaluation, wind-down) leaves it the last figure, stamped with
    the end of the interval it describes, so the panel is not blank at the end of every run."""
    fwd = {"share": 0.5, "cpu": {"total_seconds": 3.0, "p95_seconds": 1.512, "buckets": [0, 0, 0, 2]},
           "gpu": {"total_seconds": 2.0, "p95_seconds": 0.703, "buckets": [0, 0, 1, 1]}}
    exporter.export(dict(interval({"drafter.fwd_bwd": fwd}, 10), time_unix=1796600000.25))
    p95 = lambda got, clock: got.get(("dflash_span_p95_seconds",   # noqa: E731
                                      frozenset({"span": "drafter.fwd_bwd", "clock": clock}.items())))
    got = samples(scrape(exporter))
    assert (p95(got, "cpu"), p95(got, "gpu")) == (1.512, 0.703)
    exporter.export(dict(interval({"drafter.recv": span(0.1, [1, 0, 0, 0], 0.01)}, 20), time_unix=1796600001.25))
    text = scrape(exporter)
    got = samples(text)
    assert (p95(got, "cpu"), p95(got, "gpu")) == (1.512, 0.703)
    lines = [ln for ln in exposition_lines(text, "dflash_span_p95_seconds") if 'span="drafter.fwd_bwd"' in ln]
    assert len(lines) == 2 and all(ln.endswith(" 1796600000250") for ln in lines), lines
    exporter.export(dict(interval({"drafter.fwd_bwd": dict(fwd, cpu=dict(fwd["cpu"], p95_seconds=0.9))}, 30),
                         time_unix=1796600002.25))
    assert p95(samples(scrape(exporter)), "cpu") == 0.9
    exporter.export(dict(interval({}, 40), time_unix=1796600002.25 + 300.5))   # past Prometheus' lookback: gone
    assert (p95(samples(scrape(exporter)), "cpu"), p95(samples(scrape(exporter)), "gpu")) == (None, None)


def test_a_client_trickling_bytes_loses_its_slot_at_the_request_deadline(monkeypatch):
    """Issue 46: a byte every 0.3 s never trips a per-recv timeout; the whole request has READ_TIMEOUT_S. Every
    slot held by such a client, and still a scrape is answered once their deadline has passed."""
    from exporters import prometheus
    monkeypatch.setattr(prometheus, "READ_TIMEOUT_S", 1.0)
    exp = PrometheusExporter({"rank": 0, "role": "drafter", "host": "h"}, port=0)
    try:
        slow = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(prometheus.MAX_CONNECTIONS)]
        start, closed = time.monotonic(), set()
        while len(closed) < len(slow) and time.monotonic() - start < 6.0:
            for i, s in enumerate(slow):
                if i not in closed:
                    try:
                        s.sendall(b"G")
                    except OSError:
                        closed.add(i)
            time.sleep(0.3)
        held_s = time.monotonic() - start
        assert len(closed) == len(slow) and held_s < 4.0, (len(closed), held_s)
        body = urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=5).read().decode()
        assert "dflash_" in body
        for s in slow:
            s.close()
    finally:
        exp.close(1.0)
