"""What a background thread's GIL-releasing calls cost a busy training thread (a hypothesis of #14).

    python3 bench/bench_gil_handoff.py [--seconds 3] [--repeats 5] [--rates 0,250,1000,4000]

Every torch op on a training thread releases and retakes the GIL. The question this bench asks: does a
background thread that also releases it often cost the training thread more than its calls' own time?
It was written for the profiler's collector on the belief that `Event.query()` and `elapsed_time()`
release the GIL; they do not (torch/csrc/cuda/Event.cpp holds it through both: bench/RESULTS.md, eighth
session), so the collector is not such a thread. The bench stays for background threads that do release
it (ctypes.CDLL calls, file and socket I/O).

The training thread here: a loop of small torch ops on a CPU tensor (each releases and retakes the
GIL, as a launch-bound step's ops do), counted for `--seconds`. A background thread, woken 4 times a
second like the collector, makes `rate / 4` calls per wake of one of two kinds:
- `release`: `os.stat("/")`, a ~1 us system call that releases the GIL and retakes it (as query() and
  elapsed_time() do around their driver call; `time.sleep(0)` would cost ~60 us of timer slack);
- `hold`: the same CPU time spent in pure Python, holding the GIL throughout (measured first).
The floor is the same loop with no background calls, measured just before and just after each
measurement (their mean); the two threads are pinned to two CPUs, so they contend for the GIL, not a
core. Reported per kind and rate: the training loop's slowdown, and that slowdown divided by the
background calls, in microseconds of training-thread time per call, beside what one call costs the
background thread itself.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

WAKES_PER_S = 4


def train_loop(seconds: float) -> float:
    """Small torch ops for `seconds`; ops per second."""
    x = torch.zeros(16)
    n, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    while True:
        for _ in range(100):
            x.add_(1.0)
        n += 100
        if time.perf_counter() >= deadline:
            break
    return n / (time.perf_counter() - t0)


def _hold_work(n: int) -> None:
    s = 0
    for i in range(n):
        s += i


def calibrate_hold(target_s: float) -> int:
    """Loop count of _hold_work that takes about target_s (an os.stat's own cost)."""
    n = 1000
    while True:
        t0 = time.perf_counter()
        _hold_work(n)
        took = time.perf_counter() - t0
        if took > 0.01:
            return max(1, int(n * target_s / took))
        n *= 4


def call_cost_s(n: int = 50000) -> float:
    """What one os.stat("/") costs its own thread, alone."""
    t0 = time.perf_counter()
    for _ in range(n):
        os.stat("/")
    return (time.perf_counter() - t0) / n


def background(kind: str, rate: float, stop: threading.Event, hold_n: int, made: list) -> None:
    per_wake = int(rate / WAKES_PER_S)
    while not stop.wait(1.0 / WAKES_PER_S):
        for _ in range(per_wake):
            if kind == "release":
                os.stat("/")
            else:
                _hold_work(hold_n)
        made[0] += per_wake


def measure(kind: str, rate: float, seconds: float, hold_n: int, cpus: tuple) -> tuple[float, float]:
    """(training ops/s, background calls/s) with the background thread running on its own CPU."""
    stop, made = threading.Event(), [0]

    def run() -> None:
        _pin(cpus[1])
        background(kind, rate, stop, hold_n, made)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ops = train_loop(seconds)
    stop.set()
    thread.join()
    return ops, made[0] / seconds


def _pin(cpu) -> None:
    """The calling thread onto one CPU (Linux: pid 0 is the calling thread); None leaves it."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def one_repeat(a: argparse.Namespace, hold_n: int, cpus: tuple, rows: dict) -> None:
    """Each (kind, rate) against the mean of the floors measured just before and just after it."""
    floor = train_loop(a.seconds)
    for kind in ("release", "hold"):
        for rate in a.rates:
            ops, calls = measure(kind, rate, a.seconds, hold_n, cpus)
            after = train_loop(a.seconds)
            base = (floor + after) / 2.0
            lost_s = (1.0 / ops - 1.0 / base) * ops    # training time lost per second
            rows.setdefault((kind, rate), []).append((1 - ops / base, lost_s / calls if calls else 0.0))
            floor = after


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rates", default="250,1000,4000", help="background calls per second, comma-separated")
    a = ap.parse_args(argv)
    try:
        a.rates = [float(r) for r in a.rates.split(",")]
    except ValueError:
        ap.error(f"--rates: comma-separated numbers, got {a.rates!r}")
    if a.seconds <= 0 or a.repeats < 1 or any(r <= 0 for r in a.rates):
        ap.error("--seconds > 0, --repeats >= 1 and every rate > 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpus = (allowed[0], allowed[1]) if len(allowed) >= 2 else (None, None)
    _pin(cpus[0])
    own_s = call_cost_s()
    hold_n = calibrate_hold(own_s)
    rows: dict = {}
    for _ in range(a.repeats):
        one_repeat(a, hold_n, cpus, rows)
    print(f"training loop: small torch ops, 1 thread on CPU {cpus[0]}, background on CPU {cpus[1]}; one background "
          f"call's own cost {1e6 * own_s:.2f} us; {a.repeats} repeats of {a.seconds:g} s, each against the floors "
          "measured just before and after it")
    print("| background | calls/s | training slowdown (median) | training time per call (median, range) |")
    print("|---|---|---|---|")
    for (kind, rate), vals in rows.items():
        slow = statistics.median(v[0] for v in vals)
        per = sorted(1e6 * v[1] for v in vals)
        print(f"| {kind} | {rate:,.0f} | {100 * slow:+.2f}% | {statistics.median(per):.1f} us "
              f"({per[0]:.1f} .. {per[-1]:.1f}) |")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
