"""The collector's CPU per span (drain, replay, CUDA resolution, aggregation), on any machine.

Run from the repo root: `python3 bench/bench_collector.py` (PYTHONPATH=.). In a run the collector is a
thread of its own that takes the GIL from the training thread, so its cost per span is part of what
profiling costs a host-bound loop. Rows, each the median of REPEATS over N spans in chains of 12 (the
shape of a step), drained every CHUNK spans as the collector's poll would:
- `cpu spans`: CPU-timed spans (the floor: what every span costs the collector);
- `cuda spans, shared starts`: CUDA-shaped records with events, adjacent spans sharing a boundary event
  (the pool's reference counting, the resolution of completed pairs);
- `cuda spans, own starts`: the same with sharing off (two events per span);
- `cuda spans, 1 step in 10`: shared starts, with the GPU timed on one step in ten at random (the others' spans
  are CPU records): about what `dflash-train --profile-gpu-steps-per-s 5` does at ~50 steps a second.
A second table: turning an interval's metric values (0-dim tensors) into floats at close, batched
(`profiler.intervals.to_floats_by_name`) against the per-name conversion it replaced.
The CUDA rows use host-side stand-in events (query/elapsed_time are Python, about 0.1 us each; a real
torch event's are 0.25 and 0.75 us on an H200 host), so they measure the collector's own Python, not
the CUDA calls. Writes nothing outside a temporary run dir ($OUT if set).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

N = int(os.environ.get("BENCH_COLLECTOR_N", "24000"))
REPEATS = int(os.environ.get("BENCH_COLLECTOR_REPEATS", "5"))
CHUNK = 2400
NAMES = [f"bench.stage{i}" for i in range(12)]


class StandInEvent:
    """A completed-at-once event on a host clock: what the collector sees of a finished GPU pair."""
    __slots__ = ("t",)

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter_ns()

    def query(self):
        return self.t is not None

    def elapsed_time(self, end):
        return (end.t - self.t) / 1e6


def collector_ns(profiler, run_root: str, pool_factory, share_gap_ns: int, gpu_p: float = 1.0) -> float:
    """Collector thread-CPU ns per span over N spans (the spans themselves untimed); `gpu_p`: the chance that a
    step is GPU-timed (profiler/cuda_timing.py GpuSampler)."""
    from profiler import spans as spans_mod

    old, spans_mod.SHARE_GAP_NS = spans_mod.SHARE_GAP_NS, share_gap_ns
    spent = 0
    try:
        run_dir = tempfile.mkdtemp(dir=run_root)
        with profiler.Profiler(run_dir, interval_s=3600.0, console=False, measure_floors=False, control=False,
                               background=False, event_pool=pool_factory()) as prof:
            prof.gpu_sampler.p, prof.gpu_sampler.burst = gpu_p, 0
            for _ in range(N // CHUNK):
                for i in range(CHUNK // len(NAMES)):
                    profiler.set_step(i)
                    for name in NAMES:
                        with profiler.span(name):
                            pass
                t0 = time.thread_time_ns()
                prof.aggregator.add_drained(prof.recorder.drain())
                prof.aggregator.resolve_pending()
                spent += time.thread_time_ns() - t0
            t0 = time.thread_time_ns()
            prof.aggregator.close_parts(1.0)
            spent += time.thread_time_ns() - t0
    finally:
        spans_mod.SHARE_GAP_NS = old
    return spent / (N // CHUNK * CHUNK)


METRIC_NAMES, METRIC_STEPS = 9, 200   # the drafter's metrics, an interval's steps on the H200 launch workload


def metric_close_ns(convert) -> float:
    """ns per value to turn an interval's metrics (0-dim tensors, as dflash logs them) into floats."""
    import torch

    metrics = {f"m{k}": [torch.tensor(0.5 * i) for i in range(METRIC_STEPS)] for k in range(METRIC_NAMES)}
    t0 = time.perf_counter_ns()
    convert(metrics)
    return (time.perf_counter_ns() - t0) / (METRIC_NAMES * METRIC_STEPS)


def per_name_reference(metrics: dict) -> dict:
    """The conversion before it was batched (af4cd0c..9c606d8): one stack and read per name, each value
    reshaped and cast first."""
    import torch

    return {n: torch.stack([v.detach().reshape(()).float() for v in vals]).tolist() for n, vals in metrics.items()}


def metric_table() -> None:
    from profiler.intervals import to_floats_by_name

    cases = {"per name, reshape+cast (before)": per_name_reference,
             "one pass (to_floats_by_name)": lambda m: to_floats_by_name(m)}
    runs: dict = {k: [] for k in cases}
    for _ in range(REPEATS):
        for name, fn in cases.items():
            runs[name].append(metric_close_ns(fn))
    print(f"metrics at interval close: {METRIC_NAMES} names x {METRIC_STEPS} steps of 0-dim tensors; "
          f"{REPEATS} repeats (median)")
    for k, v in runs.items():
        print(f"{k:<34} {statistics.median(v):>8.1f} ns/value  " + " ".join(f"{x:.0f}" for x in v))


def main() -> int:
    import profiler
    from profiler.cuda_timing import EventPool

    run_root = tempfile.mkdtemp(prefix="bench_collector_", dir=os.environ.get("OUT") or None)
    cases = {"cpu spans": (lambda: None, 0),
             "cuda spans, shared starts": (lambda: EventPool(StandInEvent, prealloc=256), 10**9),
             "cuda spans, own starts": (lambda: EventPool(StandInEvent, prealloc=256), -1),
             "cuda spans, 1 step in 10": (lambda: EventPool(StandInEvent, prealloc=256), 10**9, 0.1)}
    runs: dict = {k: [] for k in cases}
    for _ in range(REPEATS):   # alternate cases within each repeat so drift hits all alike
        for name, (factory, gap, *p) in cases.items():
            runs[name].append(collector_ns(profiler, run_root, factory, gap, *p))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"python {sys.version.split()[0]}; {N} spans in chains of {len(NAMES)}, drained every {CHUNK}; "
          f"{REPEATS} repeats (median)")
    print(f"{'case':<28} {'ns/span':>9} {'x cpu':>7}  runs")
    for k, v in med.items():
        print(f"{k:<28} {v:>9.1f} {v / med['cpu spans']:>7.2f}  " + " ".join(f"{x:.0f}" for x in runs[k]))
    metric_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
