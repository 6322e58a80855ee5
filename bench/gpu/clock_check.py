"""Three clocks over the same work: the host's (perf_counter), CUDA events' and torch.profiler's (Kineto/CUPTI).

    python3 bench/gpu/clock_check.py [--reps 5]

A span's GPU window (two CUDA events) is compared with Kineto's in tests/integration/test_capture_cuda.py; on
an H100 it read 1.3% longer for a 6-matmul span, on an H200 0.03-2%. This tells a per-span lead-in (a fixed
offset: the ratio falls as the work grows) from a clock that runs at another rate (the same ratio at every
length), by timing single `torch.cuda._sleep` kernels of about 1, 10 and 50 ms, each:
  host    perf_counter around launch + synchronize (an upper bound: launch and sync latency included)
  events  cudaEventElapsedTime of events recorded right before and after the kernel
  kineto  the kernel's duration in the trace (CUPTI activity timestamps, converted by Kineto)
and a 100 ms host sleep inside a `record_function`: perf_counter against Kineto's CPU range. The peer of every
figure is another clock in the same run; nothing is typed in. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def cycles_per_ms() -> float:
    """The sleep kernel's cycles per millisecond at the present clock, from a 20 ms probe timed by events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)   # warm-up: the kernel loaded, the clocks up
    a.record()
    torch.cuda._sleep(40_000_000)
    b.record()
    b.synchronize()   # deliberate: the probe's time is read before the measured kernels
    return 40_000_000 / a.elapsed_time(b)


def timed_sleeps(lengths_ms: list, reps: int, per_ms: float) -> list:
    """[(label, host_ms, event_ms)] in launch order, each kernel inside a record_function named by its label."""
    out = []
    for ms in lengths_ms:
        for k in range(reps):
            label = f"sleep{ms}ms.{k}"
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()   # deliberate: each kernel starts on an idle GPU, so host time brackets it
            t0 = time.perf_counter()
            with torch.profiler.record_function(label):
                a.record()
                torch.cuda._sleep(int(ms * per_ms))
                b.record()
            b.synchronize()   # deliberate: the host clock stops when the kernel is done
            out.append((label, 1e3 * (time.perf_counter() - t0), a.elapsed_time(b)))
    return out


def kineto_kernels(trace: dict, labels: list) -> dict:
    """{label: the duration (ms) of the one kernel inside its gpu_user_annotation range} (a range holding any
    other count is left out)."""
    events = trace.get("traceEvents", [])
    ranges = {e["name"]: e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name") in labels}
    kernels = [e for e in events if e.get("cat") == "kernel"]   # torch.cuda._sleep's is ATen's spin_kernel
    out = {}
    for label, r in ranges.items():
        inside = [k for k in kernels if r["ts"] <= k["ts"] < r["ts"] + r["dur"]]
        if len(inside) == 1:
            out[label] = inside[0]["dur"] / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    per_ms = cycles_per_ms()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as kp:
        rows = timed_sleeps([1, 10, 50], a.reps, per_ms)
        t0 = time.perf_counter()
        with torch.profiler.record_function("host_sleep_100ms"):
            time.sleep(0.1)
        host_sleep_ms = 1e3 * (time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        kp.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    kin = kineto_kernels(trace, [r[0] for r in rows])
    cpu = next((e["dur"] / 1e3 for e in trace["traceEvents"]
                if e.get("name") == "host_sleep_100ms" and e.get("cat") == "user_annotation"), None)
    print(f"{torch.cuda.get_device_name()}: sleep kernels, {a.reps} each, medians (ms) and ratios")
    print(f"{'kernel':<10} {'host':>9} {'events':>9} {'kineto':>9} {'events/kineto':>14} {'events/host':>12}")
    for ms in (1, 10, 50):
        mine = [r for r in rows if r[0].startswith(f"sleep{ms}ms.") and r[0] in kin]
        if not mine:
            print(f"{ms:>4} ms    no kernel matched in the trace")
            continue
        host, ev = statistics.median(r[1] for r in mine), statistics.median(r[2] for r in mine)
        k = statistics.median(kin[r[0]] for r in mine)
        print(f"{ms:>4} ms   {host:>9.3f} {ev:>9.3f} {k:>9.3f} {ev / k:>14.4f} {ev / host:>12.4f}")
    if cpu:
        print(f"host sleep: perf_counter {host_sleep_ms:.3f} ms, Kineto's CPU range {cpu:.3f} ms, "
              f"ratio perf_counter/Kineto {host_sleep_ms / cpu:.4f}")


if __name__ == "__main__":
    main()
