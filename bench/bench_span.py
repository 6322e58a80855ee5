"""Per-span CPU cost of profiler.span vs peers, in one process (CPU only).

Run from the repo root: `python3 bench/bench_span.py` (PYTHONPATH=.). Prints the thread CPU ns per
span (median of repeats; the min too) for: profiler.span active (CPU timing; and with bytes=, which
makes a span object per call), inactive (no profiler), prometheus_client Histogram.time(),
torch.profiler.record_function outside a profiler, a bare no-op context manager behind a function call
(the floor), and an empty loop; ratios to Histogram.time() and the goals
(active <= 0.25x, inactive <= 0.12x), and the active ratio paired within each repeat. Writes nothing
outside a temporary run dir ($OUT if set). The process pins itself to one CPU (BENCH_SPAN_CPU, default the
one it starts on): on a VM whose vCPUs run at different speeds, a loop moved between them mid-repeat
skews one side of a ratio.

`--mirror` adds the capture's rows (profiler/capture.py): an active span while spans are mirrored as
record_function ranges with no torch.profiler running (the mirror's own cost), inside a live torch.profiler
capture (what a captured step pays, Kineto's recording included), and after the capture ended (back to the
plain span: the claim that outside a capture the mirror costs nothing).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from common import env_int, parser

N = env_int("BENCH_SPAN_N", 200000, 5000)
REPEATS = env_int("BENCH_SPAN_REPEATS", 7, 1)
CHUNK = 5000
GOALS = {"span active (cpu)": 0.25, "span inactive": 0.12}


class _Noop:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        return False


_NOOP = _Noop()


def _noop_cm(name):
    return _NOOP


# CPU time of this thread: on a shared machine, time spent preempted by other processes is not
# the span's cost (wall time is what the loop sees only on an idle machine).
_cpu_ns = time.thread_time_ns


def _loop_cm(make, name, n):
    """Time n `with make(name): pass`; returns CPU ns per iteration."""
    t0 = _cpu_ns()
    for _ in range(n):
        with make(name):
            pass
    return (_cpu_ns() - t0) / n


def _loop_empty(n):
    t0 = _cpu_ns()
    for _ in range(n):
        pass
    return (_cpu_ns() - t0) / n


def _active(prof, make, name) -> float:
    """CPU ns per active span: chunks of CHUNK spans, each followed by an untimed interval close (the
    public drain), so the span buffer stays as short as the collector thread keeps it in a real run."""
    spent_ns = 0.0
    for _ in range(N // CHUNK):
        spent_ns += _loop_cm(make, name, CHUNK) * CHUNK
        prof.close_interval()
    return spent_ns / (N // CHUNK * CHUNK)


def _paired_line(results: dict) -> str:
    """Active span over Histogram.time() within each repeat (their loops run back to back), median and
    range over repeats: the host's drift from one repeat to the next cancels in each ratio."""
    ratios = sorted(a / h for a, h in zip(results["span active (cpu)"], results["histogram.time()"]))
    goal = GOALS["span active (cpu)"]
    return (f"span active / histogram.time(), paired by repeat: median {statistics.median(ratios):.3f} "
            f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}; goal <= {goal:.2f}: "
            f"{'yes' if statistics.median(ratios) <= goal else 'NO'})")


def _pin() -> int:
    """Pin this process to one CPU (BENCH_SPAN_CPU, else the current one); returns it."""
    stat = open("/proc/self/stat").read()
    spec = os.environ.get("BENCH_SPAN_CPU") or stat[stat.rindex(")") + 2:].split()[36]   # `processor`
    try:
        os.sched_setaffinity(0, [int(spec)])
    except (ValueError, OSError) as e:
        print(f"bench_span: BENCH_SPAN_CPU={spec!r} is not a CPU this process may use "
              f"({sorted(os.sched_getaffinity(0))}): {e}", file=sys.stderr)
        sys.exit(2)
    return int(spec)


def _mirror_rows(prof, ref_ns: float) -> None:
    """The span's cost before mirroring, mirrored with no profiler, after mirroring is off (the three in turn
    within each repeat, so each ratio is paired), and mirrored inside a live torch.profiler capture."""
    import profiler
    import torch
    from profiler.kineto import record_function_ranges

    def active():
        return _active(prof, profiler.span, "target.fwd")
    rows: dict = {"plain (before)": [], "mirrored, no capture": [], "after the capture": []}
    with prof:
        for _ in range(REPEATS):
            rows["plain (before)"].append(active())
            prof.recorder.set_ranges(record_function_ranges())
            rows["mirrored, no capture"].append(active())
            prof.recorder.set_ranges(None)
            rows["after the capture"].append(active())
        prof.recorder.set_ranges(record_function_ranges())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            rows["mirrored, in capture"] = [active() for _ in range(2)]
        prof.recorder.set_ranges(None)
    plain = rows["plain (before)"]
    print(f"{'mirror case':<22} {'ns/span':>9} {'x hist':>8} {'x plain (paired by repeat)':>28}")
    for name, v in rows.items():
        paired = statistics.median(x / p for x, p in zip(v, plain))
        print(f"{name:<22} {statistics.median(v):>9.1f} {statistics.median(v) / ref_ns:>8.3f} {paired:>28.3f}")


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--mirror", action="store_true", help="add the capture's rows (see above)")
    mirror = ap.parse_args().mirror
    cpu = _pin()
    import profiler
    from prometheus_client import CollectorRegistry, Histogram
    import torch

    hist = Histogram("bench_span_seconds", "bench", registry=CollectorRegistry())
    cases = {
        "histogram.time()": lambda n: _loop_cm(lambda _name: hist.time(), "x", n),
        "span inactive": lambda n: _loop_cm(profiler.span, "target.fwd", n),
        "record_function": lambda n: _loop_cm(torch.profiler.record_function, "target.fwd", min(n, 50000)),
        "noop cm (floor)": lambda n: _loop_cm(_noop_cm, "target.fwd", n),
        "empty loop": _loop_empty,
    }
    run_dir = tempfile.mkdtemp(prefix="bench_span_", dir=os.environ.get("OUT") or None)
    # background=False: the timed loop measures the training thread's hot path alone (the collector's
    # share of a real run is its `profiler_share`).
    prof = profiler.Profiler(run_dir, config=profiler.ProfilerConfig(interval_s=3600.0, measure_floors=False,
                                                                     control=False, background=False))
    results: dict = {k: [] for k in ["span active (cpu)", "active, bytes=", *cases]}
    for _ in range(REPEATS):   # alternate cases within each repeat so drift hits all of them alike
        for name, fn in cases.items():
            results[name].append(fn(N))
        with prof:
            results["span active (cpu)"].append(_active(prof, profiler.span, "target.fwd"))
            results["active, bytes="].append(_active(prof, lambda name: profiler.span(name, bytes=4096), "d2h_copy"))
    med = {k: statistics.median(v) for k, v in results.items()}
    best = {k: min(v) for k, v in results.items()}
    ref = med["histogram.time()"]
    floor = med["noop cm (floor)"]
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, N={N}, repeats={REPEATS} (median), "
          f"pinned to CPU {cpu}")
    print(f"{'case':<20} {'ns/span':>9} {'x hist':>8} {'goal':>6}  ok   | min ns  x hist (min)")
    for k, v in med.items():
        goal = GOALS.get(k)
        ok = "" if goal is None else ("yes" if v / ref <= goal else "NO")
        print(f"{k:<20} {v:>9.1f} {v / ref:>8.3f} {('' if goal is None else f'{goal:.2f}'):>6}  {ok:<4} | "
              f"{best[k]:>6.0f}  {best[k] / best['histogram.time()']:.3f}")
    print(_paired_line(results))
    if mirror:
        _mirror_rows(prof, ref)
    print(f"active minus floor: {med['span active (cpu)'] - floor:.1f} ns; "
          f"inactive minus floor: {med['span inactive'] - floor:.1f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
