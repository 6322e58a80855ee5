"""CUDA span overhead on a GPU: a loop of ~10 ms GPU steps (a chain of bf16 matmuls) with 12
CUDA-timed spans per step vs the same loop uninstrumented (no profiler at all), repeats alternating;
then the CPU cost of one empty CUDA span, back to back (each span records its own start and end event),
in thread CPU time and wall time, against the floor of the two records it makes (the C record plus the
raw current-stream lookup, round-robin over 4096 events as a run's spans take pool events, twice; also
paired, chunk by chunk, with those records timed just before each chunk of spans).

Run from the repo root on a CUDA host: `python3 bench/bench_span_cuda.py` (PYTHONPATH=.). Goals:
slowdown <= 1%, a span <= 2 us above its two records. Run logs go to a temporary dir ($OUT if set). ~40 s.
Settings from the environment: BENCH_STEPS (60) steps per repeat, BENCH_REPEATS (9), BENCH_CPU_REPEATS (5).
"""
from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import time

from common import env_int, parser

SPANS_PER_STEP = 12
RECORDS_PER_SPAN = 2   # a CUDA span records its own start and end event
STEP_TARGET_S = 0.010
STEPS = env_int("BENCH_STEPS", 60, 1)
REPEATS = env_int("BENCH_REPEATS", 9, 1)
N_CPU = 20000
CPU_REPEATS = env_int("BENCH_CPU_REPEATS", 5, 1)


def setup(torch):
    """Device, the matmul chain and the number of matmuls per span for a ~10 ms step."""
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
    return dev, mm_chain, max(1, round(STEP_TARGET_S / SPANS_PER_STEP / mm_s)), mm_s


def make_prof(profiler, run_root, tag, dev, background=True):
    config = profiler.ProfilerConfig(interval_s=1.0, control=False, background=background)
    return profiler.Profiler(os.path.join(run_root, tag), device=dev, config=config,
                             deps=profiler.ProfilerDeps(floors={}))


def slowdown(torch, profiler, run_root, dev, mm_chain, per_span):
    """(plain runs, instrumented runs) in seconds per STEPS steps, alternating."""
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

    def timed(fn, n):
        torch.cuda.synchronize()          # deliberate: bench boundaries only
        t0 = time.perf_counter()
        fn(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    plain, instr = [], []
    plain_steps(5)
    with make_prof(profiler, run_root, "warmup", dev):
        span_steps(5)
    for r in range(REPEATS):              # alternate so drift (clocks, thermals) hits both alike
        plain.append(timed(plain_steps, STEPS))
        with make_prof(profiler, run_root, f"r{r}", dev):
            instr.append(timed(span_steps, STEPS))
    return plain, instr


def span_cpu_ns(torch, profiler, run_root, dev, n=N_CPU, chunk=2000):
    """(thread CPU ns, wall ns, paired ns above its two records) per empty span, back to back. Paired:
    before each chunk of spans, a chunk of the records they make (record_loop) is timed on the same thread,
    and the median over chunks of their difference is taken, so the host's drift from one moment to the
    next hits both sides alike. Between chunks an untimed interval close drains what the spans recorded."""
    floor = record_loop(torch)
    cpu = wall = 0
    above = []
    with make_prof(profiler, run_root, f"cpu_{time.perf_counter_ns()}", dev, background=False) as prof:
        for _ in range(n // chunk):
            f0 = time.thread_time_ns()
            floor(chunk * RECORDS_PER_SPAN)
            f_ns = time.thread_time_ns() - f0
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(chunk):
                with profiler.span("bench.empty"):
                    pass
            s_ns = time.thread_time_ns() - c0
            cpu, wall = cpu + s_ns, wall + time.perf_counter_ns() - w0
            above.append((s_ns - f_ns) / chunk)
            torch.cuda.synchronize()   # deliberate: bench, so the close finds the events done
            prof.close_interval()
    done = n // chunk * chunk
    return cpu / done, wall / done, statistics.median(above)


def record_loop(torch):
    """loop(n): n iterations of what a span's record costs: the raw-stream lookup and the C record,
    round-robin over 4096 distinct events as a run's spans record pool events until they are resolved."""
    many = itertools.cycle([torch.cuda.Event(enable_timing=True) for _ in range(4096)])
    getraw, idx = torch._C._cuda_getCurrentRawStream, torch.cuda.current_device()
    streams = {getraw(idx): torch.cuda.current_stream()}
    rec = torch._C._CudaEventBase.record

    def loop(n):
        for _ in range(n):
            rec(next(many), streams[getraw(idx)])

    return loop


def record_ns(torch, n=N_CPU):
    """Thread CPU ns of one record_loop iteration (the floor of a span's own records), after a warm-up."""
    loop = record_loop(torch)
    loop(1000)
    c0 = time.thread_time_ns()
    loop(n)
    spent_ns = time.thread_time_ns() - c0
    torch.cuda.synchronize()   # deliberate: bench, the records done before the spans are timed
    return spent_ns / n


def main() -> int:
    import torch
    import profiler

    parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        print("bench_span_cuda: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, mm_chain, per_span, mm_s = setup(torch)
    run_root = tempfile.mkdtemp(prefix="bench_span_cuda_", dir=os.environ.get("OUT") or None)
    plain, instr = slowdown(torch, profiler, run_root, dev, mm_chain, per_span)
    p_med, i_med = statistics.median(plain), statistics.median(instr)
    record_floor_ns = record_ns(torch)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; step = {SPANS_PER_STEP} spans x "
          f"{per_span} bf16 4096^3 matmuls = {per_span * SPANS_PER_STEP * mm_s * 1e3:.1f} ms GPU; "
          f"{STEPS} steps x {REPEATS} repeats")
    print(f"{'case':<34} {'median s':>9} {'ms/step':>8}  runs")
    for label, runs, med in (("uninstrumented", plain, p_med), ("12 CUDA spans/step", instr, i_med)):
        print(f"{label:<34} {med:>9.4f} {med / STEPS * 1e3:>8.3f}  " + " ".join(f"{x:.4f}" for x in runs))
    print(f"slowdown: {(i_med / p_med - 1) * 100:+.2f}% (goal <= 1%: {'yes' if i_med / p_med <= 1.01 else 'NO'})")
    print(f"floor (thread CPU): C record + raw stream lookup {record_floor_ns / 1e3:.2f} us over 4096 events")
    # Repeats, medians: one 20,000-span run can swing by microseconds between calls on a VM host.
    runs = [span_cpu_ns(torch, profiler, run_root, dev) for _ in range(CPU_REPEATS)]
    cpu, wall, paired = (statistics.median(x[i] for x in runs) for i in range(3))
    print(f"empty CUDA span, back to back: cpu {cpu / 1e3:.2f} us, wall {wall / 1e3:.2f} us, above its "
          f"{RECORDS_PER_SPAN} records {(cpu - RECORDS_PER_SPAN * record_floor_ns) / 1e3:+.2f} us, paired "
          f"{paired / 1e3:+.2f} us (goal <= 2 us); cpu us per repeat " + " ".join(f"{x[0] / 1e3:.2f}" for x in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
