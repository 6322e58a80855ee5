"""Exporter costs: the scrape of one rank with every family populated, and each exporter's CPU time per
interval record, against the same HTTP server scraping an empty registry (the floor) in the same run.

    .venv/bin/python bench/bench_exporters.py [--scrapes 200] [--intervals 200]

The interval record is a realistic one: 12 spans with CPU and GPU histograms, bytes and floors, 8 GPUs'
NVML and allocator memory with throttle reasons, counters, gauges and training metrics, and a `spans`
detail record of 3 steps (about 60 spans) for the trace and OTel exporters.
"""
from __future__ import annotations

import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import common
from profiler.stats import HISTOGRAM_BUCKETS_SECONDS

SPANS = ["target.fetch", "target.fwd", "target.pack_hidden", "d2h_copy", "transfer.wait_slot", "transfer.send",
         "drafter.recv", "h2d_copy", "drafter.fwd_bwd", "drafter.allreduce", "drafter.optim", "ckpt.save"]


def stats(i: int) -> dict:
    n = len(HISTOGRAM_BUCKETS_SECONDS) + 1
    return {"total_seconds": 1.0 + i, "mean_seconds": 0.01, "p50_seconds": 0.01, "p95_seconds": 0.02,
            "p99_seconds": 0.03, "max_seconds": 0.05, "buckets": [(i + k) % 7 for k in range(n)]}


def interval_record(index: int) -> dict:
    spans = {name: {"count": 10, "threads": ["target.main"], "cpu": stats(i), "gpu": stats(i + 1), "share": 0.05,
                    "bytes": 1 << 28, "bandwidth_bytes_per_s": 4e11, "floor": "device_copy",
                    "floor_bytes_per_s": 4e12, "floor_ratio": 0.1} for i, name in enumerate(SPANS)}
    gpus = [{"index": g, "name": "NVIDIA H200", "total_bytes": 150e9, "used_bytes_last": 80e9,
             "used_bytes_peak": 90e9, "headroom_bytes": 60e9, "util_percent_mean": 97.0, "power_watts_mean": 650.0,
             "temperature_c_max": 70.0, "sm_clock_hz_last": 1.98e9, "throttle_reasons": ["sw_power_cap"],
             "samples": 120} for g in range(8)]
    alloc = {"available": True, "allocated_bytes": 7e10, "reserved_bytes": 8e10, "peak_allocated_bytes": 7.5e10,
             "peak_reserved_bytes": 8.2e10, "num_alloc_retries": 0, "num_ooms": 0}
    return {"type": "interval", "time_unix": time.time(), "rank": 0, "role": "drafter", "index": index,
            "step": index * 10, "duration_seconds": 60.0, "spans": spans,
            "counters": {"tokens": {"total": 6e5, "per_second": 1e4, "run_total": 6e5 * (index + 1)},
                         "steps": {"total": 100, "per_second": 1.6, "run_total": 100 * (index + 1)}},
            "gauges": {"queue_depth": {"last": 1, "mean": 1.2, "max": 2}},
            "metrics": {m: {"last": 1.0, "mean": 1.0} for m in ("loss", "tau", "tau_prefix", "lr", "grad_norm",
                                                               "acc_1", "acc_2", "acc_3", "acc_4")},
            "memory": {"available": True, "gpus": gpus, "allocator": alloc, "sampler_errors": 0},
            "exporters": {"prometheus": {"exported": index, "dropped": 0, "failed": False}}}


def spans_record(index: int, t0_ns: int) -> dict:
    out, sid = [], 0
    for step in range(3):
        for name in SPANS[:5] + ["transfer.send"]:
            start = t0_ns + (step * 100 + sid) * 1_000_000
            out.append({"id": sid, "parent": None, "name": name, "thread": "target.main", "tid": 1234, "depth": 0,
                        "start_unix_ns": start, "end_unix_ns": start + 900_000, "cpu_seconds": 9e-4,
                        "gpu_seconds": 8e-4, "bytes": None, "attrs": {"flow": f"1:{step}"}})
            sid += 1
    return {"type": "spans", "time_unix": time.time(), "rank": 1, "role": "target", "index": index,
            "steps": [0, 2], "spans": out * 3, "dropped": 0}


def time_scrapes(port: int, n: int) -> list:
    url = f"http://127.0.0.1:{port}/metrics"
    urllib.request.urlopen(url).read()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        urllib.request.urlopen(url).read()
        out.append(time.perf_counter() - t0)
    return out


def cpu_per_export(exporter, records: list) -> list:
    out = []
    for rec in records:
        t0 = time.thread_time()
        exporter.export(rec)
        out.append(time.thread_time() - t0)
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--intervals", type=int, default=200)
    args = ap.parse_args()
    from prometheus_client import CollectorRegistry, start_http_server

    from exporters.prometheus import PrometheusExporter
    from exporters.trace import TraceExporter

    floor_server, _ = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    prom = PrometheusExporter({"rank": 0, "role": "drafter", "host": "bench"}, port=0)
    start = {"type": "run_start", "time_unix": time.time(), "rank": 0, "role": "drafter", "schema": 1,
             "histogram_buckets_seconds": list(HISTOGRAM_BUCKETS_SECONDS), "clock": {"perf_counter_ns": 0,
                                                                                  "unix_ns": time.time_ns()}}
    prom.export(start)
    intervals = [interval_record(i) for i in range(args.intervals)]
    prom_cpu = cpu_per_export(prom, intervals)
    text = urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics").read()
    rows = [("scrape, every family (8 GPUs, 12 spans)", time_scrapes(prom.port, args.scrapes)),
            ("scrape, empty registry (HTTP floor)", time_scrapes(floor_server.server_port, args.scrapes)),
            ("prometheus export() CPU per interval", prom_cpu)]
    with tempfile.TemporaryDirectory() as tmp:
        trace = TraceExporter(Path(tmp), 1)
        trace.export(dict(start, rank=1, role="target"))
        recs = [spans_record(i, time.time_ns()) for i in range(20)]
        rows.append(("trace export() CPU per spans record (54 spans)", cpu_per_export(trace, recs)))
        trace.close(5.0)
    print(f"scrape body: {len(text) / 1024:.1f} KiB, {len(text.splitlines())} lines")
    print(common.table(["what", "n", "p50 ms", "p95 ms", "max ms"],
                       [[name, len(xs), *(f"{x * 1e3:.3f}" for x in (statistics.median(xs), common.quantile(xs, 0.95),
                                                                      max(xs)))] for name, xs in rows]))
    prom.close(1.0)
    floor_server.shutdown()


if __name__ == "__main__":
    main()
