"""The one fold from run-log records to metric samples (exporters/fold.py), and the two live sinks that map its
samples: the same quantities, the same values, for one record stream."""
from __future__ import annotations

import math
import urllib.request

import pytest

from exporters.catalog import FAMILIES, THROTTLE_REASONS, counter_family, gauge_family
from exporters.fold import P95_KEPT_S, Buckets, Fold
from profiler.stats import HISTOGRAM_BUCKETS_SECONDS

BOUNDS = [0.01, 0.1, 1.0]
T0 = 1_800_000_000.0


def run_start(**extra) -> dict:
    return {"type": "run_start", "time_unix": T0, "role": "drafter", "schema": 1, "t_s": 10.0,
            "histogram_buckets_seconds": BOUNDS, **extra}


def interval(time_unix=T0 + 60, spans=None, **extra) -> dict:
    return {"type": "interval", "time_unix": time_unix, "role": "drafter", "step": 5, "spans": spans or {}, **extra}


def values(samples, key: str) -> dict:
    """{labels: value} of one family's samples (the last wins, as a sink keeps it)."""
    return {s.labels: s.value for s in samples if s.family.key == key}


def test_wait_spans_are_the_run_starts_span_table_of_kind_wait_for_the_records_role():
    """A loop's own pipeline names its wait spans in run_start's span_table; a log without one falls back to
    profiler.schema.span_kinds.FALLBACK (the trainer's transfer.wait_slot and drafter.recv)."""
    fold = Fold()
    table = {"loop.wait": {"role": "trainer", "kind": "wait"}, "loop.step": {"role": "trainer", "kind": "work"},
             "feeder.wait": {"role": "feeder", "kind": "wait"}}
    fold(run_start(role="trainer", span_table=table))
    got = fold(interval(role="trainer", spans={"loop.wait": {"share": 0.25}, "loop.step": {"share": 0.7}}))
    assert values(got, "wait_share") == {("loop.wait",): 0.25}
    fold = Fold()
    fold(run_start())
    assert values(fold(interval(spans={"drafter.fwd_bwd": {"share": 0.9}})), "wait_share") == {("drafter.recv",): 0.0}
    assert values(fold(interval(role="target")), "wait_share") == {("transfer.wait_slot",): 0.0}


def test_counters_are_run_totals_and_ticks_stamp_theirs_across_a_resumed_segment():
    fold = Fold()
    opening = fold.opening(T0 - 1)
    assert values(opening, "events") == {(kind,): 0.0 for kind in ("nonfinite", "oom", "thread_crash", "signal",
                                                                    "bad_records", "hang", "numerics_drift")}
    assert {s.family.key: s.stamp_unix for s in opening if s.stamp_unix is not None} == {
        "tokens": T0 - 1, "samples": T0 - 1, "steps": T0 - 1, "profiled_seconds": T0 - 1}
    fold(run_start())
    copy = {"share": 0.1, "bytes": 100, "bandwidth_bytes_per_s": 1e4}
    for _ in range(2):
        got = fold(interval(spans={"transfer.send": copy}, duration_seconds=2.0, profiler_share=0.25,
                            threads_cpu_seconds={"drafter.main": 1.5}))
    fold({"type": "event", "kind": "oom", "time_unix": T0})
    assert (values(got, "intervals"), values(got, "profiler_cpu_seconds")) == ({(): 2.0}, {(): 1.0})
    assert values(got, "thread_cpu") == {("drafter.main",): 3.0}
    assert values(got, "span_bytes") == {("transfer.send",): 200}
    assert values(fold({"type": "event", "kind": "oom", "time_unix": T0}), "events") == {("oom",): 2.0}
    tick = {"type": "tick", "time_unix": T0 + 4, "t_s": 14.0, "counters": {"tokens": 4096, "loop_items": 7},
            "spans": {"drafter.fwd_bwd": {"count": 3, "cpu_seconds": 2.5, "self_seconds": 2.0}}}
    got = fold(tick)
    assert all(s.stamp_unix == T0 + 4 for s in got if s.family.key != "heartbeat")
    assert values(got, "tokens") == {(): 4096} and values(got, "loop_items") == {(): 7}
    assert values(got, "span_time") == {("drafter.fwd_bwd", "cpu"): 2.5}   # no gpu_seconds: no GPU series
    assert values(got, "profiled_seconds") == {(): 4.0}
    fold(run_start(t_s=100.0))                                               # a resumed segment
    assert values(fold(dict(tick, t_s=103.0)), "profiled_seconds") == {(): 7.0}


def test_a_histogram_holds_whole_spans_and_their_whole_time_not_the_time_inside_the_interval():
    """A span that crossed into the interval has more time inside it than the ended spans' whole time and vice
    versa; the buckets count whole spans, so the sum is mean x count, interval by interval."""
    fold = Fold()
    fold(run_start())
    e = {"share": 0.5, "count": 2, "cpu": {"total_seconds": 3.0, "mean_seconds": 0.5, "max_seconds": 0.6,
                                           "buckets": [0, 0, 2, 0]}, "gpu": None}
    fold(interval(spans={"ckpt.save": e}))
    got = fold(interval(spans={"ckpt.save": dict(e, count=1, cpu=dict(e["cpu"], mean_seconds=2.0, max_seconds=2.0,
                                                                        buckets=[0, 0, 0, 1]))}))
    assert values(got, "span_seconds") == {("ckpt.save", "cpu"): Buckets((0.01, 0.1, 1.0), (0, 0, 2, 1), 3.0, 2.0)}
    other = Fold()
    other(run_start(histogram_buckets_seconds=[0.5]))
    assert not values(other(interval(spans={"ckpt.save": e})), "span_seconds")   # buckets of other bounds


def test_ended_series_a_p95_past_its_lookback_a_withdrawn_run_end_and_replaced_build_info():
    fold = Fold()
    fold(run_start(version="1.0"))
    stats = {"total_seconds": 1.0, "p95_seconds": 0.4, "buckets": [0, 0, 1, 0]}
    got = fold(interval(spans={"drafter.fwd_bwd": {"share": 0.5, "cpu": stats}}))
    assert [(s.value, s.stamp_unix) for s in got if s.family.key == "span_p95"] == [(0.4, T0 + 60)]
    assert not values(fold(interval(time_unix=T0 + 60 + P95_KEPT_S)), "span_p95")   # kept: not yet past
    assert values(fold(interval(time_unix=T0 + 61 + P95_KEPT_S)), "span_p95") == {("drafter.fwd_bwd", "cpu"): None}
    fold({"type": "run_end", "time_unix": T0 + 500, "status": "hang"})
    got = fold(run_start(version="1.1"))
    assert values(got, "run_end") == {("hang",): None}
    assert [(s.labels[0], s.value) for s in got if s.family.key == "build_info"] == [("1.0", None), ("1.1", 1.0)]


def test_mfu_is_the_intervals_model_flops_rate_over_each_peak_of_its_segment():
    fold = Fold()
    samples = [x for rec in stream() for x in fold(rec)]
    got = {(x.family.key, x.labels): x.value for x in samples if x.family.key in ("mfu", "peak_flops",
                                                                                  "model_flops_rate")}
    assert got == {("model_flops_rate", ()): 1e14, ("peak_flops", ("datasheet",)): 989.4e12,
                   ("peak_flops", ("measured",)): 5e14, ("mfu", ("datasheet",)): 1e14 / 989.4e12,
                   ("mfu", ("measured",)): 0.2}
    start, interval = stream()[:2]
    no_peaks = {k: v for k, v in start.items() if k != "compute_peaks"}
    fresh = Fold()
    keys = {x.family.key for rec in (no_peaks, interval) for x in fresh(rec)}
    assert "model_flops_rate" in keys and not keys & {"mfu", "peak_flops"}   # a CPU rank without peaks: a rate


def test_nonfinite_scalars_are_nan_and_every_throttle_reason_is_a_series():
    fold = Fold()
    fold(run_start())
    gpu = {"index": 1, "name": None, "uuid": None, "total_bytes": 100, "used_bytes_last": 40,
           "throttle_reasons": ["sw_thermal"]}
    got = fold(interval(metrics={"loss": {"last": None, "mean": None}, "lr": {"last": 1e-4, "mean": 2e-4},
                                 "acc_2": {"last": 0.5, "mean": 0.25}, "my_own": {"last": 1.0, "mean": 1.0}},
                        memory={"available": True, "gpus": [gpu],
                                "allocator": {"available": True, "allocated_bytes": 7, "num_ooms": 0}}))
    assert math.isnan(values(got, "train_loss")[()]) and values(got, "train_learning_rate") == {(): 1e-4}
    assert values(got, "train_accuracy") == {("2",): 0.25}
    assert values(got, "gpu_throttle") == {("1", "", r): float(r == "sw_thermal") for r in THROTTLE_REASONS}
    assert values(got, "alloc_allocated") == {("1", ""): 7.0} and values(got, "alloc_ooms") == {("1", ""): 0.0}
    assert {s.about for s in got if s.family.key == "gpu_headroom"} == {(("hw.id", "gpu-index-1"),
                                                                         ("hw.name", "unknown"))}
    no_nvml = fold(interval(memory={"available": False, "allocator": {"available": True, "reserved_bytes": 9}}))
    assert values(no_nvml, "alloc_reserved") == {("0", ""): 9.0}


def forecast_event(gpu: str = "h1:0", largest: int | None = 12288, **tokens) -> dict:
    """A `memory_forecast` event (docs/RUNLOG.md): --tokens-per-batch limited by `gpu`, --num-anchors not limited by
    memory and without a largest (the run's value not a number)."""
    return {"type": "event", "kind": "memory_forecast", "time_unix": T0 + 30, "headroom_share": 0.05, "steps": 40,
            "reason": None, "settings": [
                {"flag": "--tokens-per-batch", "current": 8192, "largest": largest, "scale": 1.5,
                 "need_bytes_at_current": 6e10, "limit_bytes": 9e10, "gpu": gpu, "ranks": [0, 1],
                 "transient_steps": [], **tokens},
                {"flag": "--num-anchors", "current": None, "largest": None, "scale": 1024.0,
                 "need_bytes_at_current": 6e10, "limit_bytes": 9e10, "gpu": "h1:0", "ranks": [0, 1],
                 "transient_steps": [3]}]}


def test_a_memory_forecast_gives_each_settings_gauges_and_ends_those_the_next_one_does_not():
    """Per setting its largest (none where the event has none), its scale and the limiting GPU's need and limit,
    beside the event's count; a later forecast limited by another GPU, or without a largest, ends the series it no
    longer gives, and so does a new segment (its settings may differ)."""
    fold = Fold()
    fold(run_start())
    got = fold(forecast_event())
    assert values(got, "events") == {("memory_forecast",): 1.0}
    assert values(got, "memory_forecast_largest") == {("--tokens-per-batch",): 12288.0}
    assert values(got, "memory_forecast_scale") == {("--tokens-per-batch",): 1.5, ("--num-anchors",): 1024.0}
    assert values(got, "memory_forecast_need") == {("--tokens-per-batch", "h1:0"): 6e10,
                                                   ("--num-anchors", "h1:0"): 6e10}
    assert values(got, "memory_forecast_limit") == {("--tokens-per-batch", "h1:0"): 9e10,
                                                    ("--num-anchors", "h1:0"): 9e10}
    assert {s.family.name for s in got} >= {"dflash_memory_forecast_largest", "dflash_memory_forecast_scale_ratio",
                                            "dflash_memory_forecast_need_bytes", "dflash_memory_forecast_limit_bytes"}
    got = fold(forecast_event(gpu="h1:1", largest=None, scale=1.02, need_bytes_at_current=8.8e10))
    assert values(got, "events") == {("memory_forecast",): 2.0}
    assert values(got, "memory_forecast_largest") == {("--tokens-per-batch",): None}   # ended, not repeated
    assert values(got, "memory_forecast_scale") == {("--tokens-per-batch",): 1.02, ("--num-anchors",): 1024.0}
    assert values(got, "memory_forecast_need") == {("--tokens-per-batch", "h1:0"): None,
                                                   ("--tokens-per-batch", "h1:1"): 8.8e10,
                                                   ("--num-anchors", "h1:0"): 6e10}
    assert [s.labels for s in got if s.value is None] == [   # the ends come before the new figures
        ("--tokens-per-batch",), ("--tokens-per-batch", "h1:0"), ("--tokens-per-batch", "h1:0")]
    ended = fold(run_start(t_s=100.0))
    assert {(s.family.key, s.labels) for s in ended if s.value is None} == {
        (key, labels) for key, labels in (("memory_forecast_scale", ("--tokens-per-batch",)),
                                          ("memory_forecast_scale", ("--num-anchors",)),
                                          ("memory_forecast_need", ("--tokens-per-batch", "h1:1")),
                                          ("memory_forecast_need", ("--num-anchors", "h1:0")),
                                          ("memory_forecast_limit", ("--tokens-per-batch", "h1:1")),
                                          ("memory_forecast_limit", ("--num-anchors", "h1:0")))}
    assert not [s for s in fold(forecast_event(largest=None)) if s.value is None]   # nothing left to end


# ---- both sinks, one stream -----------------------------------------------------------------------------------
UUID = "GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12"


def stream() -> list:
    """Records that feed every folded family of the catalog, plus a loop's own counter and gauge."""
    head = {"time_unix": T0, "rank": 1, "role": "drafter"}
    n = len(HISTOGRAM_BUCKETS_SECONDS) + 1
    stats = {"total_seconds": 0.5, "mean_seconds": 0.05, "p95_seconds": 0.07, "max_seconds": 0.08,
             "buckets": [0] * 8 + [10] + [0] * (n - 9)}   # 10 spans in (0.025, 0.05]
    gpu = {"index": 0, "name": "H200", "uuid": UUID, "total_bytes": 100, "used_bytes_last": 40, "used_bytes_peak": 60,
           "headroom_bytes": 40, "util_percent_mean": 90.0, "power_watts_mean": 500.0, "temperature_c_max": 60,
           "sm_clock_hz_last": 1.98e9, "throttle_reasons": ["sw_power_cap"], "sm_active_percent_mean": 80.0,
           "tensor_active_percent_mean": 12.5, "sm_occupancy_percent_mean": 40.0, "dram_active_percent_mean": 30.0}
    spans = {"drafter.fwd_bwd": {"count": 10, "gpu_count": 10, "share": 0.4, "cpu": stats, "gpu": stats},
             "drafter.recv": {"count": 0, "share": 0.1, "cpu": None, "gpu": None},
             "h2d_copy": {"count": 10, "share": 0.01, "cpu": stats, "gpu": None, "bytes": 1 << 20,
                          "bandwidth_bytes_per_s": 2e9, "floor": "pinned_h2d", "floor_bytes_per_s": 2.5e10,
                          "floor_ratio": 0.08}}
    interval_ = {**head, "type": "interval", "step": 10, "duration_seconds": 60.0, "profiler_share": 0.003,
                 "threads_cpu_seconds": {"drafter.main": 50.0}, "spans": spans,
                 "counters": {"tokens": {"total": 40960, "per_second": 682.5, "run_total": 40960},
                              "samples": {"total": 40, "per_second": 0.667, "run_total": 40},
                              "steps": {"total": 10, "per_second": 0.1667, "run_total": 10},
                              "model_flops": {"total": 6e15, "per_second": 1e14, "run_total": 6e15}},
                 "gauges": {"queue_depth": {"last": 1, "mean": 1.5, "max": 3}, "loop_gauge": {"last": 2, "mean": 2,
                                                                                             "max": 2}},
                 "metrics": {"loss": {"last": 2.5, "mean": 2.75}, "tau": {"last": 3.0, "mean": 2.9},
                             "tau_prefix": {"last": 2.0, "mean": 1.9}, "lr": {"last": 1e-4, "mean": 9e-5},
                             "grad_norm": {"last": 1.0, "mean": 1.1}, "acc_1": {"last": 0.8, "mean": 0.7}},
                 "memory": {"available": True, "gpus": [gpu], "allocator": {
                     "available": True, "allocated_bytes": 7, "reserved_bytes": 9, "peak_allocated_bytes": 8,
                     "peak_reserved_bytes": 10, "num_alloc_retries": 1, "num_ooms": 0}},
                 "numerics": {"every": 1, "warnings": 0, "stages": {"drafter.fwd_bwd/loss": {
                     "span": "drafter.fwd_bwd", "tensor": "loss", "samples": 10, "absmax_max": 2.9, "rms_last": 2.5,
                     "growth_per_step": 0.98, "headroom_binades": 126.5, "near_overflow_fraction_max": 0.0,
                     "underflow_fraction_max": 0.0}}},
                 "exporters": {"trace": {"exported": 3, "dropped": 2, "failed": False}}}
    tick = {**head, "type": "tick", "t_s": 60.0, "counters": {"tokens": 40960, "samples": 40, "steps": 10,
                                                              "loop_counter": 3, "model_flops": 6e15},
            "spans": {"drafter.fwd_bwd": {"count": 10, "cpu_seconds": 0.5, "self_seconds": 0.4, "gpu_seconds": 0.5,
                                          "gpu_self_seconds": 0.45, "gpu_count": 10}}}
    table = {"drafter.recv": {"role": "drafter", "kind": "wait"},
             "drafter.fwd_bwd": {"role": "drafter", "kind": "work"}}
    return [{**head, "type": "run_start", "schema": 1, "version": "0.1", "t_s": 0.0, "span_table": table,
             "histogram_buckets_seconds": list(HISTOGRAM_BUCKETS_SECONDS),
             "compute_peaks": {"datasheet": {"flops_per_s": 989.4e12, "what": "datasheet dense bf16 (H100/H200 SXM)"},
                               "measured": {"flops_per_s": 5e14, "what": "bf16 8192x8192x8192 matmul"}}},
            interval_, tick, {**head, "type": "event", "kind": "nonfinite"}, {**head, **forecast_event()},
            {**head, "type": "run_end", "status": "ok", "time_unix": T0 + 61}]


def _parsed_name(family) -> str:
    """The family's name as prometheus_client's text parser gives it: a counter's without `_total`."""
    return family.name[:-len("_total")] if family.kind == "counter" else family.name


def _prometheus_series(records) -> dict:
    """{(family key, labels less the common ones and UUID): value or (count, sum)} from a scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    from exporters.prometheus import PrometheusExporter

    exporter = PrometheusExporter({"rank": 1, "role": "drafter", "host": "h"}, port=0)
    try:
        for rec in records:
            exporter.export(rec)
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
    finally:
        exporter.close(0.0)
    parsed = {_parsed_name(f): f
              for f in (*FAMILIES.values(), counter_family("loop_counter"), gauge_family("loop_gauge"))}
    out = {}
    for mf in text_string_to_metric_families(text):
        family = parsed.get(mf.name)
        if family is None or family.otel is None:   # process_*: read at scrape time, not folded
            continue
        for smp in mf.samples:
            labels = frozenset((k, v) for k, v in smp.labels.items() if k not in ("rank", "role", "host", "UUID"))
            if family.kind == "histogram":
                if smp.name.endswith(("_count", "_sum")):
                    key = (family.key, labels)
                    count, sum_s = out.get(key, (None, None))
                    out[key] = (smp.value, sum_s) if smp.name.endswith("_count") else (count, smp.value)
            elif family.kind == "info":
                out[family.key, frozenset()] = dict(labels)
            else:
                out[family.key, labels] = smp.value
    return out


def _otel_series(records, receiver) -> dict:
    """The same from what an OTLP receiver decoded: the catalog's OTel names mapped back to its keys."""
    from exporters.otel import OtelExporter

    exporter = OtelExporter(receiver.url, rank=1, role="drafter", run_id="r", host="h", metric_interval_s=60.0)
    for rec in records:
        exporter.export(rec)
    exporter.close(5.0)
    by_name = {f.otel.name: f for f in (*FAMILIES.values(), counter_family("loop_counter"),
                                        gauge_family("loop_gauge")) if f.otel is not None}
    drop = {"rank", "role", "host", "hw.type", "hw.gpu.task", "hw.id", "hw.name"}
    out = {}
    for req in receiver.metrics:
        for m in (m for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics):
            family, data = by_name[m.name], getattr(m, m.WhichOneof("data"))
            for p in data.data_points:
                attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in p.attributes}
                labels = frozenset((k, v) for k, v in attrs.items() if k not in drop)
                if family.kind == "histogram":
                    out[family.key, labels] = (p.count, p.sum)
                elif family.kind == "info":
                    out[family.key, frozenset()] = dict(labels)
                else:
                    out[family.key, labels] = getattr(p, p.WhichOneof("value"))
    return out


def test_both_sinks_expose_the_same_quantities_with_the_same_values(otlp_receiver_cls):
    pytest.importorskip("opentelemetry.sdk")
    receiver = otlp_receiver_cls()
    try:
        otel = _otel_series(stream(), receiver)
    finally:
        receiver.close()
    prom = _prometheus_series(stream())
    folded = {key for key, f in FAMILIES.items() if f.otel is not None} | {"loop_counter", "loop_gauge"}
    assert {key for key, _ in prom} == folded, folded ^ {key for key, _ in prom}
    assert {key for key, _ in otel} == folded, folded ^ {key for key, _ in otel}
    assert prom.keys() == otel.keys(), prom.keys() ^ otel.keys()
    for series, value in prom.items():
        if isinstance(value, tuple):   # a histogram: count exact, the sum to the placement's rounding
            assert otel[series][0] == value[0] and otel[series][1] == pytest.approx(value[1]), series
        else:
            assert otel[series] == pytest.approx(value), series
    assert prom["wait_share", frozenset({("span", "drafter.recv")})] == 0.1
    assert prom["gpu_throttle", frozenset({("gpu", "0"), ("reason", "sw_power_cap")})] == 1.0
    assert prom["exporter_dropped", frozenset({("exporter", "trace")})] == 2.0
