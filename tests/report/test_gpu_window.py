"""A span's GPU time is named its GPU window on every surface, with what the GPU did in it beside it (the always-on
class from profiler/gpu_lag.py and a busy estimate); findings send launch-bound spans to launch fixes, not to
bandwidth; a host-staged send is held to the host path's floor."""
from __future__ import annotations

import json

import pytest

from profiler import report
from exporters.console import format_interval
from profiler.floors import floor_for_span
from profiler.intervals import IntervalAggregator
from profiler.spans import SpanRecord
from tests.report.test_findings import _pipeline

FLOORS = {"device_copy": 4.2e12, "pinned_d2h": 50e9, "pinned_h2d": 40e9, "host_copy": 20e9}


def _lag(n: int, launch: int, gpu: int) -> dict:
    return {"n": n, "launch_bound": launch, "gpu_bound": gpu, "start_lag_p50_s": 4e-6, "end_lag_p50_s": 9e-6,
            "window_seconds": 1.0, "tail_seconds": 0.001, "tolerance_s": 5e-5, "unplaced": 0}


def _with_lags(run_dir, lags: dict, sm_active_percent=None):
    """The run's interval span entries given `gpu_lag` {span: entry} (and GPM SM active on its GPUs)."""
    for path in (run_dir / "profile").glob("rank*.jsonl"):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for rec in recs:
            if rec.get("type") != "interval":
                continue
            for name, lag in lags.items():
                if name in rec["spans"]:
                    rec["spans"][name]["gpu_lag"] = lag
            for g in (rec.get("memory") or {}).get("gpus") or []:
                g["sm_active_percent_mean"] = sm_active_percent
        path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return run_dir


@pytest.fixture
def launch_bound_run(tmp_path):
    """One GPU: the target's transfer.send at 4% of its floor, but launch-bound (its GPU kept pace with the host);
    the drafter's fwd_bwd GPU-bound; GPM says SMs 6% active."""
    run = _pipeline(tmp_path / "run", ("cuda:0", "cuda:0"))
    return _with_lags(run, {"transfer.send": _lag(100, 97, 0), "drafter.fwd_bwd": _lag(100, 0, 90),
                            "target.fwd": _lag(100, 50, 20)}, sm_active_percent=6.0)


def test_hotspots_names_the_gpu_window_and_shows_the_class_and_busy_beside_it(launch_bound_run):
    rep = report.hotspots(launch_bound_run)
    rows = {r["span"]: r for r in rep["spans"]["rows"]}
    send = rows["transfer.send"]
    assert send["gpu_window_seconds"] == pytest.approx(0.05 * 100 * 12, rel=0.2) and "gpu_seconds" not in send
    assert send["gpu_bound"]["class"] == "launch-bound"
    assert send["gpu_bound"]["busy_share"] == pytest.approx(0.06) and send["gpu_bound"]["busy_source"] == "GPM SM active"
    assert rows["drafter.fwd_bwd"]["gpu_bound"]["class"] == "GPU-bound"
    assert rows["target.fwd"]["gpu_bound"]["class"] == "mixed"
    assert rows["transfer.wait_slot"]["gpu_bound"] is None
    text = report.format_hotspots(rep)
    assert "GPU window s" in text and "gpu s" not in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("transfer.send "))
    assert "launch-bound" in line and "6%" in line
    assert "launch-bound: transfer.send" in text


def test_a_launch_bound_copy_gets_the_launch_finding_and_no_bandwidth_finding(launch_bound_run, tmp_path):
    """... while the same copy GPU-bound keeps its bandwidth finding."""
    found = report.hotspots(launch_bound_run)["findings"]
    assert not [f for f in found if f["kind"] == "below_floor"]
    (launch,) = [f for f in found if f["kind"] == "launch_bound"]
    assert launch["summary"].startswith("transfer.send (target) is launch-bound")
    assert "CUDA graphs" in launch["next"] and "torch.compile" in launch["next"] and "larger batch" in launch["next"]
    assert "97% of 1200 spans" in launch["evidence"] and "busy 6% (GPM SM active)" in launch["evidence"]
    busy = _with_lags(_pipeline(tmp_path / "busy", ("cuda:0", "cuda:0")), {"transfer.send": _lag(100, 10, 80)})
    kinds = [f["kind"] for f in report.hotspots(busy)["findings"]]
    assert "below_floor" in kinds and "launch_bound" not in kinds


def test_the_console_interval_block_shows_the_class_and_gpm_busy():
    rec = {"rank": 0, "role": "drafter", "index": 3, "step": 40, "duration_seconds": 10.0,
           "spans": {"drafter.fwd_bwd": {"count": 10, "share": 0.9, "gpu": {"mean_seconds": 0.9, "p95_seconds": 1.0},
                                         "cpu": {"total_seconds": 9.0}, "gpu_lag": _lag(10, 10, 0)},
                     "drafter.recv": {"count": 10, "share": 0.05, "cpu": {"mean_seconds": 0.05}}},
           "memory": {"gpus": [{"index": 0, "sm_active_percent_mean": 6.0, "used_bytes_peak": 1, "total_bytes": 2,
                                "headroom_bytes": 1}]}}
    text = format_interval(rec)
    fwd = next(ln for ln in text.splitlines() if "drafter.fwd_bwd" in ln)
    recv = next(ln for ln in text.splitlines() if "drafter.recv" in ln)
    assert "launch-bound" in fwd and "6%" in fwd and "launch-bound" not in recv
    assert "GPU window" in text and "GPU-bound (it ran behind the host)" in text


def test_a_host_staged_send_is_held_to_the_host_paths_floor():
    assert floor_for_span("transfer.send", FLOORS, True, "host") == ("host_staged",
                                                                     pytest.approx(1 / (1 / 50e9 + 1 / 40e9)))
    assert floor_for_span("transfer.send", FLOORS, True) == ("device_copy", 4.2e12)
    assert floor_for_span("transfer.send", {"device_copy": 4.2e12}, True, "host") is None   # unmeasured: none
    agg = IntervalAggregator(FLOORS, floor_for_span, is_cuda=False)
    rec = SpanRecord.of("transfer.send", 0, 10_000_000, 0, 10_000_000, 1, None, {"flow": "1:0", "path": "host"})
    agg.add_drained([("target.sender", [rec], [])])
    entry = agg.close_parts(1.0)["spans"]["transfer.send"]
    assert entry["floor"] == "host_copy"            # the CPU: every copy is a host copy
    agg = IntervalAggregator(FLOORS, floor_for_span, is_cuda=True)
    agg.add_drained([("target.sender", [rec], [])])
    entry = agg.close_parts(1.0)["spans"]["transfer.send"]
    assert entry["floor"] == "host_staged" and entry["floor_ratio"] == pytest.approx(1e9 / (1 / (1 / 50e9 + 1 / 40e9)))
    assert agg.run_parts(1.0)["spans"]["transfer.send"]["floor"] == "host_staged"


def test_the_end_of_run_table_says_its_cuda_times_are_gpu_windows():
    from exporters.console import format_hotspots
    end = {"role": "drafter", "rank": 0, "duration_seconds": 10.0, "counters": {},
           "spans": {"drafter.fwd_bwd": {"count": 10, "share": 0.9, "cpu": {"total_seconds": 9.0},
                                         "gpu": {"total_seconds": 9.1, "mean_seconds": 0.91, "p95_seconds": 1.0}}}}
    assert "GPU window" in format_hotspots([end])
    cpu = {**end, "spans": {"drafter.fwd_bwd": {"count": 10, "cpu": {"total_seconds": 9.0, "mean_seconds": 0.9}}}}
    assert "GPU window" not in format_hotspots([cpu])
