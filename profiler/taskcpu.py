"""Per-thread CPU of a run's rank processes, read from /proc around each phase of `dflash-profile overhead`.

The on/off difference says what profiling costs; this says on which thread. Around every phase the
client reads each live rank's threads' scheduler statistics (`/proc/PID/task/TID/schedstat`: nanoseconds
on a CPU, nanoseconds runnable but waiting for one), and sums each thread's growth per arm. Per thread
and arm the summary is microseconds per step of rank 0 (the meter) and the thread's busy share (its CPU over
the arm's wall time, between the same readings).

Reading it: a profiler thread's CPU per step is what it costs directly. A training thread's is not its own
instrumentation: its CPU per step also grows when the same work runs slower beside the profiler's threads
(caches, the GPU driver's locks), at an unchanged busy share. On the H200 host the drafter's training thread
took +297 µs a step with only the background paused, its own calls the same in both arms, at a busy share
of 69.8% against 70.2% (bench/RESULTS.md, eleventh session). A busy share that rises in the on arm says the
thread did more work per second; one that holds says it did the same work slower, or waited as much more.
Without schedstat (a kernel without CONFIG_SCHED_INFO) `/proc/PID/task/TID/stat`'s utime and
stime serve, in clock ticks (10 ms each: meaningful over hundreds of phases only); without /proc, nothing.

Standard library only; reads files, signals nothing, never touches the run's processes otherwise.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class Reading(dict):
    """{(rank, tid): (cpu ns, wait ns)} and `t_ns`, the monotonic clock when it was read."""
    __slots__ = ("t_ns",)


def _read_task(task: Path) -> tuple[int, int] | None:
    """(cpu ns, wait ns) of one thread, or None when it ended meanwhile or cannot be read."""
    try:
        fields = (task / "schedstat").read_text().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        stat = (task / "stat").read_text()
        utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]   # fields 14 and 15, after "(comm)"
        return (int(utime) + int(stime)) * TICK_NS, 0
    except (OSError, ValueError, IndexError):
        return None


class TaskCpu:
    """Reads, and sums per arm, the CPU of every thread of the given processes. `pids` maps rank to pid;
    `clock_ns` times the readings (the busy shares' wall)."""

    def __init__(self, pids: dict[int, int], proc_root: str | os.PathLike = "/proc", clock_ns=time.monotonic_ns):
        self.pids, self.root, self._clock_ns = dict(pids), Path(proc_root), clock_ns
        self.sums: dict[str, dict] = {"on": {}, "off": {}}   # arm -> (rank, tid) -> [cpu ns, wait ns]
        self.steps = {"on": 0, "off": 0}
        self.wall_ns = {"on": 0, "off": 0}   # between the readings each arm's growth was summed over
        self.comm: dict[tuple[int, int], str] = {}

    def read(self) -> Reading:
        """{(rank, tid): (cpu ns, wait ns)} now, for every readable thread of every process."""
        out = Reading()
        out.t_ns = self._clock_ns()
        for rank, pid in self.pids.items():
            try:
                tids = os.listdir(self.root / str(pid) / "task")
            except OSError:
                continue
            for tid in tids:
                got = _read_task(self.root / str(pid) / "task" / tid)
                if got is not None and tid.isdigit():
                    out[(rank, int(tid))] = got
        return out

    def add(self, arm: str, before: dict, after: dict, steps: int) -> None:
        """One phase's growth per thread (threads in both readings only), rank 0's steps in it and, when both
        are Readings, the wall time between them."""
        sums = self.sums[arm]
        t0, t1 = getattr(before, "t_ns", None), getattr(after, "t_ns", None)
        if t0 is not None and t1 is not None:
            self.wall_ns[arm] += max(0, t1 - t0)
        for key, (cpu, wait) in after.items():
            if key in before:
                acc = sums.setdefault(key, [0, 0])
                acc[0] += max(0, cpu - before[key][0])
                acc[1] += max(0, wait - before[key][1])
        self.steps[arm] += steps

    def name_of(self, rank: int, tid: int) -> str:
        """The kernel's name of a thread (its `comm`), read once; "?" once it is gone."""
        key = (rank, tid)
        if key not in self.comm:
            try:
                self.comm[key] = (self.root / str(self.pids[rank]) / "task" / str(tid) / "comm").read_text().strip()
            except OSError:
                self.comm[key] = "?"
        return self.comm[key]

    def summary(self, names: dict | None = None) -> dict:
        """Per thread: on and off CPU (and wait) in microseconds per rank-0 step, their difference, and each
        arm's busy share in percent (None without wall times), largest difference first; `names` maps (rank,
        tid) to a Python thread name (else the kernel's)."""
        if not self.steps["on"] or not self.steps["off"]:
            return {"metric": "cpu_us_per_step", "threads": []}
        rows = []
        for key in set(self.sums["on"]) | set(self.sums["off"]):
            on_ns, off_ns = self.sums["on"].get(key, (0, 0)), self.sums["off"].get(key, (0, 0))
            on = [v / 1e3 / self.steps["on"] for v in on_ns]
            off = [v / 1e3 / self.steps["off"] for v in off_ns]
            rows.append({"rank": key[0], "tid": key[1], "name": (names or {}).get(key) or self.name_of(*key),
                         "on_cpu_us": round(on[0], 2), "off_cpu_us": round(off[0], 2),
                         "diff_cpu_us": round(on[0] - off[0], 2), "on_wait_us": round(on[1], 2),
                         "off_wait_us": round(off[1], 2), "on_busy_pct": self._busy_pct("on", on_ns[0]),
                         "off_busy_pct": self._busy_pct("off", off_ns[0])})
        rows.sort(key=lambda r: (-abs(r["diff_cpu_us"]), -r["on_cpu_us"]))
        return {"metric": "cpu_us_per_step", "steps": dict(self.steps),
                "wall_seconds": {arm: ns / 1e9 for arm, ns in self.wall_ns.items()}, "threads": rows}

    def _busy_pct(self, arm: str, cpu_ns: int) -> float | None:
        """A thread's CPU as a share of the arm's wall time, in percent (None before any timed reading)."""
        wall = self.wall_ns[arm]
        return round(100.0 * cpu_ns / wall, 2) if wall else None


class NullTaskCpu:
    """No per-thread reading: measure()'s default, for callers that want the phases alone (tests)."""

    def read(self) -> dict:
        return {}

    def add(self, arm, before, after, steps) -> None:
        pass

    def summary(self, names=None) -> dict:
        return {"metric": "cpu_us_per_step", "threads": []}
