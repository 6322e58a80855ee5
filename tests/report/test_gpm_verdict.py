"""The verdict reads NVML GPM where the run log has it (docs/RUNLOG.md memory.gpus[]): a drafter GPU that NVML
calls busy in every interval while its SMs and tensor pipes mostly idle is launch-bound, not compute-bound; one
whose tensor pipes are busy is not called so; a run without GPM (CPU, pre-Hopper) gets no GPU line at all."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiler import report
from profiler.report.analysis import gpu_activity
from profiler.report.runs import load_run

T0 = 1_700_000_000.0
INTERVAL_S = 60.0


def _gpu(util: float, sm: float | None, tensor: float | None, dram: float | None) -> dict:
    return {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12",
            "total_bytes": 141 << 30, "used_bytes_last": 60 << 30, "used_bytes_peak": 61 << 30,
            "headroom_bytes": 80 << 30, "util_percent_mean": util, "sm_active_percent_mean": sm,
            "sm_occupancy_percent_mean": None, "tensor_active_percent_mean": tensor, "dram_active_percent_mean": dram,
            "samples": 120}


def _entry(seconds: float, count: int) -> dict:
    stats = {"total_seconds": seconds * count, "mean_seconds": seconds, "p50_seconds": seconds,
             "p95_seconds": seconds, "p99_seconds": seconds, "max_seconds": seconds}
    return {"count": count, "cpu": stats, "gpu": stats, "share": seconds * count / INTERVAL_S}


def _run(tmp: Path, drafter_gpu: dict | None, target_gpu: dict | None) -> Path:
    """A drafter-bound two-rank run of six intervals, its GPUs measured as given (None: no CUDA device)."""
    (tmp / "profile").mkdir(parents=True)
    for rank, role, gpu, spans in ((0, "drafter", drafter_gpu, {"drafter.fwd_bwd": _entry(0.5, 100),
                                                                "drafter.recv": _entry(0.05, 100)}),
                                   (1, "target", target_gpu, {"target.fwd": _entry(0.1, 100),
                                                              "transfer.wait_slot": _entry(0.4, 100)})):
        memory = {"available": True, "gpus": [gpu], "allocator": {"available": False, "reason": "-"}} if gpu \
            else {"available": False, "reason": "no CUDA device"}
        lines = [{"type": "run_start", "time_unix": T0, "rank": rank, "role": role, "schema": 1, "run_id": "r",
                  "hostname": "h", "world_size": 2, "device": "cuda:0" if gpu else "cpu", "interval_s": INTERVAL_S}]
        lines += [{"type": "interval", "time_unix": T0 + INTERVAL_S * (k + 1), "rank": rank, "role": role, "index": k,
                   "step": 10 * (k + 1), "duration_seconds": INTERVAL_S, "start_s": INTERVAL_S * k,
                   "end_s": INTERVAL_S * (k + 1), "spans": spans, "memory": memory,
                   "counters": {"tokens": {"total": 20_000, "per_second": 20_000 / INTERVAL_S}},
                   **({"final": True} if k == 5 else {})} for k in range(6)]
        (tmp / "profile" / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return tmp


def test_a_busy_gpu_with_idle_sms_and_tensor_pipes_is_launch_bound(tmp_path):
    run = _run(tmp_path, _gpu(99.0, 31.0, 4.0, 12.0), _gpu(97.0, 80.0, 55.0, 60.0))
    rep = report.hotspots(run)
    gpu = rep["verdict"]["gpu"]
    assert gpu["drafter"]["bound"] == "launch-bound" and gpu["target"]["bound"] is None
    assert gpu["drafter"]["samples"] == 4   # the steady window: neither the first (start-up) nor the final
    assert (gpu["drafter"]["util_percent_mean"], gpu["drafter"]["tensor_active_percent_mean"]) == (99.0, 4.0)
    text = report.format_hotspots(rep)
    assert "launch-bound, not compute-bound" in text
    assert rep["verdict"]["verdict"] == "drafter-bound"   # the pipeline verdict itself is unchanged


@pytest.mark.parametrize("drafter_gpu", [_gpu(60.0, 20.0, 2.0, 5.0),     # not busy by NVML: nothing to say
                                         _gpu(99.0, 85.0, 70.0, 40.0),   # tensor pipes busy: compute
                                         _gpu(99.0, None, None, None)])  # no GPM on this GPU
def test_no_launch_bound_verdict_without_the_evidence(tmp_path, drafter_gpu):
    gpu = gpu_activity(load_run(_run(tmp_path, drafter_gpu, None)))
    assert gpu.get("drafter", {}).get("bound") is None


def test_a_cpu_run_has_no_gpu_lines(tmp_path):
    rep = report.hotspots(_run(tmp_path, None, None))
    assert rep["verdict"]["gpu"] == {} and not any("GPM" in e for e in rep["verdict"]["evidence"])
