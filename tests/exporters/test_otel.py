"""OtelExporter against a real OTLP/HTTP receiver (an in-test HTTP server decoding the protobuf bodies),
and against a closed port: the run goes on, one warning, drops counted."""
from __future__ import annotations

import io
import logging
import re
import os
import socket
import time

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")


from opentelemetry.sdk.metrics.export import ConsoleMetricExporter  # noqa: E402

from exporters.otel import OtelExporter, from_env  # noqa: E402

T0 = 1_700_000_000_000_000_000          # Unix ns of the detail window's first span
MS = 1_000_000
UUID = "GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12"
BOUNDS = [0.01, 0.1]                    # the run_start's histogram_buckets_seconds


@pytest.fixture
def receiver(otlp_receiver_cls):
    r = otlp_receiver_cls()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    """The SDK reads OTEL_* from os.environ: none from the calling shell may leak in."""
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


def _span(id_, parent, name, thread, tid, depth, start_ms, end_ms, **extra):
    return {"id": id_, "parent": parent, "name": name, "thread": thread, "tid": tid, "depth": depth,
            "start_unix_ns": T0 + start_ms * MS, "end_unix_ns": T0 + end_ms * MS,
            "cpu_seconds": (end_ms - start_ms) / 1e3, "gpu_seconds": None, "bytes": None, **extra}


def run_records() -> list:
    """A run_start, a spans record (nested spans on two threads, one tagged with a flow), an interval, the tick
    its close writes (the run totals), an event and a run_end, shaped as docs/RUNLOG.md says."""
    head = {"time_unix": T0 / 1e9, "rank": 1, "role": "drafter"}
    stats = {"total_seconds": 0.5, "mean_seconds": 0.05, "p50_seconds": 0.05, "p95_seconds": 0.07,
             "p99_seconds": 0.08, "max_seconds": 0.08, "buckets": [0, 10, 0]}
    long = {"total_seconds": 2.0, "mean_seconds": 0.2, "p50_seconds": 0.05, "p95_seconds": 1.0,
            "p99_seconds": 1.2, "max_seconds": 1.2, "buckets": [3, 4, 3]}   # 3 spans past the last bound
    spans = [
        _span(1, None, "drafter.recv", "recv", 4001, 0, 0, 20, attrs={"flow": "0:7"}),
        _span(2, None, "drafter.fwd_bwd", "MainThread", 4000, 0, 5, 60, gpu_seconds=0.05),
        _span(3, 2, "drafter.compile", "MainThread", 4000, 1, 5, 30),
        _span(4, 3, "triton.autotune", "MainThread", 4000, 2, 10, 25, attrs={"kernel": "mm"}),
        _span(5, None, "h2d_copy", "recv", 4001, 0, 21, 23, bytes=1 << 20),
    ]
    gpu = {"index": 0, "name": "H200", "uuid": UUID, "total_bytes": 140 << 30, "used_bytes_last": 100 << 30,
           "used_bytes_peak": 120 << 30, "headroom_bytes": 20 << 30, "util_percent_mean": 90.0,
           "power_watts_mean": 500.0, "temperature_c_max": 60, "sm_clock_hz_last": 1.98e9,
           "throttle_reasons": ["sw_power_cap"], "samples": 120, "sm_active_percent_mean": 80.0,
           "tensor_active_percent_mean": 12.5, "sm_occupancy_percent_mean": None, "dram_active_percent_mean": 30.0,
           "reasons": {"sm_occupancy_percent_mean": "nvmlGpmMetricsGet: ... returned NVML error 3"}}
    interval = {**head, "type": "interval", "index": 0, "step": 10, "start_s": 0.0, "end_s": 60.0,
                "duration_seconds": 60.0, "profiler_share": 0.003,
                "spans": {"drafter.fwd_bwd": {"count": 10, "threads": ["MainThread"], "cpu": stats,
                                              "gpu": stats, "share": 0.0083},
                          "drafter.recv": {"count": 10, "threads": ["recv"], "cpu": long, "gpu": None,
                                           "share": 0.0083}},
                "counters": {"tokens": {"total": 40960, "per_second": 682.7, "run_total": 40960},
                             "steps": {"total": 10, "per_second": 0.17, "run_total": 10}},
                "gauges": {"queue_depth": {"last": 1, "mean": 1.5, "max": 3}},
                "metrics": {"loss": {"last": 2.5, "mean": 2.75}, "tau": {"last": 3.0, "mean": 2.9},
                            "tau_prefix": {"last": 2.0, "mean": 1.9}, "lr": {"last": 1e-4, "mean": 9e-5},
                            "grad_norm": {"last": 1.0, "mean": 1.1}, "acc_1": {"last": 0.8, "mean": 0.7}},
                "memory": {"available": True, "gpus": [gpu], "allocator": {"available": False, "reason": "cpu"},
                           "sampler_errors": 0},
                "threads": [{"name": "MainThread", "native_id": 4000}, {"name": "recv", "native_id": 4001}],
                "exporters": {}}
    tick = {**head, "type": "tick", "index": 0, "t_s": 60.0, "step": 10, "final": True,
            "counters": {"tokens": 40960, "steps": 10},
            "spans": {"drafter.fwd_bwd": {"count": 10, "cpu_seconds": 0.5, "self_seconds": 0.5, "gpu_seconds": 0.5,
                                          "gpu_self_seconds": 0.5, "gpu_count": 10},
                      "drafter.recv": {"count": 10, "cpu_seconds": 2.0, "self_seconds": 2.0}}}
    return [
        {**head, "type": "run_start", "schema": 1, "run_id": "run-42", "clock": {"perf_counter_ns": 0,
         "unix_ns": T0}, "t_s": 0.0, "histogram_buckets_seconds": BOUNDS, "detail_steps": 2, "device": "cuda:0"},
        {**head, "type": "spans", "index": 0, "steps": [3, 4], "spans": spans, "dropped": 0},
        interval,
        tick,
        {**head, "type": "event", "kind": "nonfinite", "step": 10},
        {**head, "type": "run_end", "step": 10, "status": "ok", "duration_seconds": 61.0, "intervals": 1},
    ]


def _attrs(kvs) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


def _received_spans(receiver) -> tuple[list, dict]:
    spans, resource = [], {}
    for req in receiver.traces:
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
    return spans, resource


def _received_metrics(receiver) -> dict:
    """metric name -> its protobuf Metric, from the last request that carried it."""
    metrics: dict = {}
    for req in receiver.metrics:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    metrics[m.name] = m
    return metrics


def _received_points(receiver) -> dict:
    """metric name -> [(attributes, value)] of number data points (the last request that carried it wins)."""
    points: dict = {}
    for name, m in _received_metrics(receiver).items():
        if m.WhichOneof("data") in ("gauge", "sum"):
            data = getattr(m, m.WhichOneof("data"))
            points[name] = [(_attrs(p.attributes), getattr(p, p.WhichOneof("value"))) for p in data.data_points]
    return points


def test_spans_and_metrics_reach_a_real_otlp_receiver(receiver):
    exporter = OtelExporter(receiver.url, rank=1, role="drafter", run_id="run-42", host="node-a",
                            timeout_s=2.0, metric_interval_s=60.0, bucket_bounds_s=BOUNDS)
    records = run_records()
    for rec in records:
        exporter.export(rec)
    t = time.monotonic()
    exporter.close(5.0)
    assert time.monotonic() - t < 4.0

    spans, resource = _received_spans(receiver)
    assert resource["service.name"] == "dflash-train"
    assert (resource["dflash.rank"], resource["dflash.role"]) == (1, "drafter")
    assert (resource["host.name"], resource["dflash.run_id"]) == ("node-a", "run-42")
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted(["profile.window", "drafter.recv", "drafter.fwd_bwd", "drafter.compile",
                                      "triton.autotune", "h2d_copy"])
    assert len({s.trace_id for s in spans}) == 1          # one trace for the window
    root = by_name["profile.window"]
    assert root.parent_span_id == b""
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (T0, T0 + 60 * MS)
    for raw in records[1]["spans"]:
        got = by_name[raw["name"]]
        assert (got.start_time_unix_nano, got.end_time_unix_nano) == (raw["start_unix_ns"], raw["end_unix_ns"])
        parent = next((p["name"] for p in records[1]["spans"] if p["id"] == raw["parent"]), "profile.window")
        assert got.parent_span_id == by_name[parent].span_id, raw["name"]
        attrs = _attrs(got.attributes)
        assert (attrs["thread.name"], attrs["thread.id"]) == (raw["thread"], raw["tid"])
        assert (attrs["dflash.step_first"], attrs["dflash.step_last"]) == (3, 4)
    assert _attrs(by_name["drafter.recv"].attributes)["dflash.flow"] == "0:7"
    assert _attrs(by_name["h2d_copy"].attributes)["dflash.bytes"] == 1 << 20
    assert _attrs(by_name["drafter.fwd_bwd"].attributes)["dflash.gpu_seconds"] == 0.05

    points = _received_points(receiver)
    for name in ("dflash.span.time", "dflash.tokens", "dflash.steps", "dflash.train.loss", "dflash.train.tau",
                 "dflash.train.tau_prefix", "dflash.train.learning_rate", "dflash.train.grad_norm",
                 "dflash.train.accuracy", "dflash.gpu.memory.headroom.low", "dflash.events", "dflash.wait.share",
                 "dflash.queue.depth", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.utilization",
                 "hw.power", "hw.temperature", "dflash.gpu.sm.activity", "dflash.gpu.tensor.activity"):
        assert name in points, name
    one = {"rank": "1", "role": "drafter", "host": "node-a"}
    gpu = {**one, "gpu": "0", "hw.id": UUID, "hw.name": "H200", "hw.type": "gpu"}
    assert points["dflash.tokens"] == [(one, 40960)]
    assert points["dflash.train.loss"] == [(one, 2.75)]
    assert points["dflash.profiler.cpu.utilization"] == [(one, 0.003)]
    assert points["dflash.train.learning_rate"] == [(one, 1e-4)]
    assert points["dflash.train.accuracy"] == [({**one, "position": "1"}, 0.7)]
    assert points["dflash.gpu.memory.headroom.low"] == [(gpu, 20 << 30)]
    assert points["hw.gpu.memory.usage"] == [(gpu, 100 << 30)] and points["hw.gpu.memory.limit"] == [(gpu, 140 << 30)]
    assert points["hw.gpu.utilization"] == [({**gpu, "hw.gpu.task": "general"}, 0.9)]
    assert points["dflash.gpu.tensor.activity"] == [(gpu, 0.125)] and "dflash.gpu.sm.occupancy" not in points
    assert ({**one, "span": "drafter.fwd_bwd", "clock": "gpu"}, 0.5) in points["dflash.span.time"]
    metrics = _received_metrics(receiver)
    units = {name: m.unit for name, m in metrics.items()}
    assert (units["dflash.span.time"], units["hw.gpu.memory.usage"], units["dflash.tokens"]) == ("s", "By", "{token}")
    unit_words = re.compile(r"(^|[._])(seconds?|bytes|ratio|total|watts|celsius|hertz|per_second)($|[._])")
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+", n) and not unit_words.search(n) for n in metrics)
    # span time is an OTLP histogram with the run log's bounds and per-bucket counts
    duration = metrics["dflash.span.duration"]
    assert duration.unit == "s" and duration.WhichOneof("data") == "histogram"
    by_span = {(_attrs(p.attributes)["span"], _attrs(p.attributes)["clock"]): p
               for p in duration.histogram.data_points}
    assert ("drafter.recv", "gpu") not in by_span
    recv = by_span["drafter.recv", "cpu"]
    assert list(recv.explicit_bounds) == BOUNDS and list(recv.bucket_counts) == [3, 4, 3] and recv.count == 10
    assert recv.sum == pytest.approx(2.0)      # the whole spans' time: mean x count
    assert list(by_span["drafter.fwd_bwd", "gpu"].bucket_counts) == [0, 10, 0]
    events = {a["kind"]: v for a, v in points["dflash.events"]}
    assert (events["nonfinite"], events["oom"]) == (1, 0)
    assert exporter.stats()["dropped"] == 0 and not exporter.stats()["failed"]
    assert exporter.stats()["exported"] >= len(spans) + len(points)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_collector_warns_once_and_counts_drops(caplog):
    caplog.set_level(logging.INFO)
    exporter = OtelExporter(f"http://127.0.0.1:{_closed_port()}", rank=0, role="target", run_id="r",
                            timeout_s=1.0, metric_interval_s=0.2, bucket_bounds_s=BOUNDS)
    t = time.monotonic()
    for rec in run_records():
        exporter.export(rec)
    assert time.monotonic() - t < 0.5        # export() never waits on the network
    time.sleep(0.5)                          # let periodic metric exports fail meanwhile
    t = time.monotonic()
    exporter.close(3.0)
    assert time.monotonic() - t < 3.5
    stats = exporter.stats()
    assert stats["failed"] and stats["dropped"] > 0 and stats["exported"] == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["exporters"], [r.getMessage() for r in warnings]
    assert "127.0.0.1" in warnings[0].getMessage()


def test_from_env_needs_an_endpoint(receiver):
    assert from_env({}, rank=0, role="target") is None
    assert from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SDK_DISABLED": "true"},
                    rank=0, role="target") is None
    traces_url = receiver.url + "/v1/traces"
    exporter = from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_url}, rank=0, role="target",
                        metric_exporter=ConsoleMetricExporter(out=io.StringIO()))
    assert exporter.endpoints == {"traces": traces_url, "metrics": None}   # metrics: the SDK's default
    exporter.close(1.0)
    exporter = from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url + "/", "OTEL_METRIC_EXPORT_INTERVAL": "100"},
                        rank=0, role="target", run_id="r")
    assert exporter.endpoints == {"traces": traces_url, "metrics": receiver.url + "/v1/metrics"}
    exporter.export(run_records()[-1])
    deadline = time.monotonic() + 10.0       # periodic exports every 100 ms; a busy host may delay a few
    while len(receiver.metrics) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(receiver.metrics) >= 2        # the interval from the environment took: 2 exports, not 1 at close
    exporter.close(2.0)
    assert exporter.stats()["exported"] > 0 and not exporter.stats()["failed"]


@pytest.mark.parametrize("counts, whole_s, max_s", [([3, 4, 3], 2.0, 1.2), ([0, 10, 0], 0.5, 0.08),
                                                    ([5, 0, 0], 0.0, 0.0), ([0, 0, 2], 700.0, 400.0),
                                                    ([1, 1, 1], 99.0, 50.0)])
def test_bucket_values_fill_each_bucket_inside_its_bounds_and_keep_the_sum(counts, whole_s, max_s):
    from exporters.otel import bucket_values

    pairs = bucket_values(counts, BOUNDS, whole_s, max_s)
    edges = [0.0, *BOUNDS, float("inf")]
    got = [0] * len(counts)
    for value, times in pairs:
        i = next(i for i in range(len(counts)) if edges[i] < value <= edges[i + 1] or (i == 0 and value == 0))
        got[i] += times
    assert got == counts
    lowest = sum(c * edges[i] for i, c in enumerate(counts))
    highest = sum(c * (edges[i + 1] if i + 1 < len(BOUNDS) + 1 else max(max_s, 2 * BOUNDS[-1]))
                  for i, c in enumerate(counts))
    total = sum(v * t for v, t in pairs)
    if lowest < whole_s <= highest:          # reachable: met to rounding
        assert total == pytest.approx(whole_s)
    else:                                    # unreachable (inconsistent input): the nearest the buckets allow
        assert total == pytest.approx(min(max(whole_s, lowest), highest), rel=1e-5, abs=1e-6)


def test_other_bucket_bounds_skip_the_histogram_with_one_warning(receiver, caplog):
    exporter = OtelExporter(receiver.url, rank=1, role="drafter", run_id="r", timeout_s=2.0, metric_interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="exporters"):
        for rec in run_records():            # BOUNDS, not the profiler's HISTOGRAM_BUCKETS_SECONDS
            exporter.export(rec)
        exporter.close(5.0)
    assert "dflash.span.duration" not in _received_metrics(receiver)
    assert "dflash.span.time" in _received_metrics(receiver)
    assert len([r for r in caplog.records if "histogram bounds" in r.getMessage()]) == 1
