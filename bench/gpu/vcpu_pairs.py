"""Which of this VM's CPUs share a physical core that the guest's topology hides (CPU only).

A KVM guest may list every vCPU as its own core (`Thread(s) per core: 1`) while the host backs two
of them with the hyperthreads of one core: a thread on one then runs slower whenever the other is
busy, for as long as the scheduler keeps both there. Run from the repo root: `python3
bench/gpu/vcpu_pairs.py [--seconds 0.25]`. For every pair of allowed CPUs, two processes pinned to
them spin at once; a's loop rate against its rate alone gives the pair's slowdown. Prints each CPU's
worst partner, the pairs slowed by more than --threshold, and a set of CPUs with no such pair
between them (greedy), to pass as `--cpus` to bench/ab_profile.py.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import queue
import sys
import time


def _spin(cpu: int, seconds: float, start, out) -> None:
    """Pinned to `cpu`, wait for the start, then count loop turns for `seconds`."""
    os.sched_setaffinity(0, [cpu])
    start.wait()
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            pass
        n += 1
    out.put((cpu, n / seconds))


def rates(cpus: tuple, seconds: float) -> dict:
    """Loop turns per second of each CPU in `cpus`, all spinning at once."""
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(len(cpus)), ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(c, seconds, start, out)) for c in cpus]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=30 + seconds) for _ in procs)
    except queue.Empty:
        for p in procs:
            p.kill()
        raise SystemExit(f"vcpu_pairs: a spinner on CPUs {list(cpus)} gave no result within {30 + seconds:.0f} s "
                         f"(exit codes {[p.exitcode for p in procs]})") from None
    for p in procs:
        p.join()
    return got


def independent_set(cpus: list, slowed: set) -> list:
    """CPUs, in order, none of which forms a slowed pair with an earlier pick."""
    picked: list = []
    for c in cpus:
        if not any(frozenset((c, p)) in slowed for p in picked):
            picked.append(c)
    return picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.25, help="spin time per measurement")
    ap.add_argument("--threshold", type=float, default=0.2, help="slowdown that marks a shared core")
    a = ap.parse_args()
    if not 0.01 <= a.seconds <= 10 or not 0 < a.threshold < 1:
        print("vcpu_pairs: --seconds must be in [0.01, 10] and --threshold in (0, 1)", file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    alone = {c: rates((c,), a.seconds)[c] for c in cpus}
    slowdown = {}
    for x, y in itertools.combinations(cpus, 2):
        r = rates((x, y), a.seconds)
        slowdown[frozenset((x, y))] = max(1 - r[x] / alone[x], 1 - r[y] / alone[y])
    print(f"{len(cpus)} CPUs; alone: {min(alone.values()):,.0f}..{max(alone.values()):,.0f} turns/s")
    for c in cpus:
        worst = max((p for p in cpus if p != c), key=lambda p: slowdown[frozenset((c, p))])
        print(f"cpu {c}: worst partner {worst} (-{100 * slowdown[frozenset((c, worst))]:.0f}%)")
    slowed = {k for k, v in slowdown.items() if v > a.threshold}
    print("slowed pairs:", sorted(tuple(sorted(k)) for k in slowed) or "none")
    print("independent:", ",".join(map(str, independent_set(cpus, slowed))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
