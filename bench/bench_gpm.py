"""What NVML GPM costs the sampler thread, and what it reads, on a Hopper GPU.

    python3 bench/bench_gpm.py [--samples 400]

1. Cost: `NvmlMemorySampler.sample_once()` (the sampler thread's body, every 0.5 s by default) timed with GPM
   and with it switched off, alternated in blocks on the same sampler, plus the two GPM calls alone
   (`nvmlGpmSampleGet`, `nvmlGpmMetricsGet`). Thread CPU and wall time per sample.
2. Readings: the interval means over 2 s of each of three loads: idle; a bf16 matmul loop (compute-bound:
   tensor pipes busy); back-to-back single-thread kernels (`torch.cuda._sleep`: a kernel always running, so
   NVML's utilisation near 100%, on one SM with no tensor work: the signature of a launch- or latency-bound
   GPU that NVML alone calls fully busy).
Prints JSON (to $OUT/bench_gpm.json too when OUT is set).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import common
from profiler.memory import GPM_METRICS, GpmReader, make_memory_sampler


def _per_sample(fn, n: int) -> dict:
    """Mean wall and thread-CPU microseconds of fn() over n calls, 0.1 s apart (GPM wants samples >= 100 ms apart)."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        wall.append((time.perf_counter_ns() - t) / 1e3)
        cpu.append((time.thread_time_ns() - c) / 1e3)
        time.sleep(0.1)
    return {"wall_us_mean": statistics.fmean(wall), "wall_us_p50": statistics.median(wall),
            "cpu_us_mean": statistics.fmean(cpu), "n": n}


def cost(sampler, samples: int) -> dict:
    """sample_once() with and without GPM, alternated in blocks of 20 on one sampler; the raw GPM calls."""
    gpu = sampler._gpus[0]
    reader, off = gpu["gpm"], GpmReader.__new__(GpmReader)
    off.reason, off.metric_errors = "switched off for the comparison", {}
    off.read = lambda: None
    on_runs, off_runs = [], []
    for _ in range(max(1, samples // 40)):
        gpu["gpm"] = reader
        on_runs.append(_per_sample(sampler.sample_once, 20))
        gpu["gpm"] = off
        off_runs.append(_per_sample(sampler.sample_once, 20))
    gpu["gpm"] = reader
    merge = lambda runs, key: statistics.fmean(r[key] for r in runs)   # noqa: E731
    import pynvml as nvml

    raw = _per_sample(lambda: nvml.nvmlGpmSampleGet(gpu["handle"], reader._samples[0]), 40)
    metrics = _per_sample(lambda: reader._metrics(*reader._samples), 40)
    return {"sample_once_with_gpm": {k: merge(on_runs, k) for k in ("wall_us_mean", "cpu_us_mean")},
            "sample_once_without_gpm": {k: merge(off_runs, k) for k in ("wall_us_mean", "cpu_us_mean")},
            "gpm_added_cpu_us": merge(on_runs, "cpu_us_mean") - merge(off_runs, "cpu_us_mean"),
            "nvmlGpmSampleGet": raw, "nvmlGpmMetricsGet": metrics, "samples_each": 20 * len(on_runs)}


def _load(kind: str, device, seconds: float) -> None:
    if kind == "idle":
        time.sleep(seconds)
        return
    big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            if kind == "matmul":
                big = (big @ big).clamp_(-1, 1)
            else:
                torch.cuda._sleep(1_000_000)   # one thread spinning ~0.5 ms
        torch.cuda.synchronize()   # deliberate: keeps the loop's work inside its window


def readings(sampler, device) -> dict:
    out = {}
    for kind in ("idle", "matmul", "launch-bound"):
        sampler.interval_summary(reset=True)
        _load(kind, device, 2.0)
        gpu = sampler.interval_summary(reset=True)["gpus"][0]
        out[kind] = {k: gpu.get(k) for k in ("util_percent_mean", *(f"{f}_mean" for f in GPM_METRICS), "samples")}
    return out


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--samples", type=int, default=400, help="sample_once() calls per arm (default 400)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with NVML")
    device = torch.device("cuda", torch.cuda.current_device())
    sampler = make_memory_sampler(device, period_s=0.1)
    gpu = sampler._gpus[0]
    result = {"device": torch.cuda.get_device_name(device), "uuid": gpu["uuid"], "gpm_reason": gpu["gpm"].reason,
              "torch": torch.__version__}
    if gpu["gpm"].reason is None:
        result["cost"] = cost(sampler, args.samples)
        sampler.start()
        result["readings"] = readings(sampler, device)
        sampler.stop()
    print(json.dumps(result, indent=2))
    common.write_out("bench_gpm.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
