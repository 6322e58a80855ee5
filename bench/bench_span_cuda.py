"""CUDA span overhead on a GPU: a loop of ~10 ms GPU steps (a chain of bf16 matmuls) with 12
CUDA-timed spans per step vs the same loop uninstrumented (no profiler at all), repeats alternating.

Run from the repo root on a CUDA host: `python3 bench/bench_span_cuda.py` (PYTHONPATH=.). Prints the
slowdown (goal <= 1%), the per-span CPU cost of an active CUDA span, and the per-call CPU cost of a
bare Event.record() for reference. Run logs go to a temporary dir ($OUT if set). Takes ~30 s.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

SPANS_PER_STEP = 12
STEP_TARGET_S = 0.010
STEPS = int(os.environ.get("BENCH_STEPS", "60"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))


def main() -> int:
    import torch
    import profiler

    if not torch.cuda.is_available():
        print("bench_span_cuda: needs a CUDA GPU")
        return 1
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def mm_chain(n):
        for _ in range(n):
            torch.matmul(a, b, out=out)

    # Calibrate: matmuls per span so that 12 spans make a ~10 ms step (deliberate syncs: set-up).
    mm_chain(20)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    mm_chain(100)
    e1.record()
    e1.synchronize()
    mm_s = e0.elapsed_time(e1) / 1000.0 / 100
    per_span = max(1, round(STEP_TARGET_S / SPANS_PER_STEP / mm_s))
    step_gpu_s = per_span * SPANS_PER_STEP * mm_s
    names = [f"bench.stage{i}" for i in range(SPANS_PER_STEP)]

    def plain_steps(n):
        for _ in range(n):
            for _ in names:
                mm_chain(per_span)

    def span_steps(n):
        for i in range(n):
            profiler.set_step(i)
            for name in names:
                with profiler.span(name):
                    mm_chain(per_span)

    run_root = tempfile.mkdtemp(prefix="bench_span_cuda_", dir=os.environ.get("OUT") or None)

    def make_prof(tag):
        return profiler.Profiler(os.path.join(run_root, tag), device=dev, interval_s=1.0, console=False,
                                 control=False, floors={})

    def timed(fn, n):
        torch.cuda.synchronize()          # deliberate: bench boundaries only
        t0 = time.perf_counter()
        fn(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    plain, instr = [], []
    plain_steps(5)
    with make_prof("warmup"):
        span_steps(5)
    for r in range(REPEATS):              # alternate so drift (clocks, thermals) hits both alike
        plain.append(timed(plain_steps, STEPS))
        with make_prof(f"r{r}"):
            instr.append(timed(span_steps, STEPS))
    p_med, i_med = statistics.median(plain), statistics.median(instr)
    slowdown = i_med / p_med - 1.0

    # CPU cost per active CUDA span (no GPU work inside; the collector drains in the background).
    n_cpu = 20000
    with make_prof("cpu_cost"):
        s = profiler.span("bench.empty")
        for _ in range(1000):
            with s:
                pass
        t0 = time.perf_counter_ns()
        for _ in range(n_cpu):
            with profiler.span("bench.empty"):
                pass
        span_ns = (time.perf_counter_ns() - t0) / n_cpu
    t0 = time.perf_counter_ns()
    for _ in range(n_cpu):
        with profiler.span("bench.empty"):
            pass
    inactive_ns = (time.perf_counter_ns() - t0) / n_cpu
    ev = torch.cuda.Event(enable_timing=True)
    for _ in range(1000):
        ev.record()
    t0 = time.perf_counter_ns()
    for _ in range(n_cpu):
        ev.record()
    record_ns = (time.perf_counter_ns() - t0) / n_cpu
    torch.cuda.synchronize()

    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; step = {SPANS_PER_STEP} spans x "
          f"{per_span} bf16 4096^3 matmuls = {step_gpu_s * 1e3:.1f} ms GPU; {STEPS} steps x {REPEATS} repeats")
    print(f"{'case':<34} {'median s':>9} {'ms/step':>8}  runs")
    print(f"{'uninstrumented':<34} {p_med:>9.4f} {p_med / STEPS * 1e3:>8.3f}  "
          + " ".join(f"{x:.4f}" for x in plain))
    print(f"{'12 CUDA spans/step':<34} {i_med:>9.4f} {i_med / STEPS * 1e3:>8.3f}  "
          + " ".join(f"{x:.4f}" for x in instr))
    print(f"slowdown: {slowdown * 100:+.2f}% (goal <= 1%: {'yes' if slowdown <= 0.01 else 'NO'})")
    print(f"CPU per active CUDA span: {span_ns / 1e3:.2f} us; inactive span: {inactive_ns:.0f} ns; "
          f"bare Event.record(): {record_ns / 1e3:.2f} us (a span does 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
