"""Per-thread CPU of a run's rank processes, read from /proc around each phase of `dflash-profile overhead`.

The on/off difference says what profiling costs; this says on which thread. Around every phase the
client reads each live rank's threads' scheduler statistics (`/proc/PID/task/TID/schedstat`: nanoseconds
on a CPU, nanoseconds runnable but waiting for one), and sums each thread's growth per arm. Per thread
and arm the summary is microseconds per step of rank 0 (the meter), so a thread whose CPU per step grows
when profiling is on shows where the cost is paid: the training thread's own instrumentation, the
profiler's threads, or neither (then the training thread waits, for the GIL or the GPU, rather than
computes). Without schedstat (a kernel without CONFIG_SCHED_INFO) `/proc/PID/task/TID/stat`'s utime and
stime serve, in clock ticks (10 ms each: meaningful over hundreds of phases only); without /proc, nothing.

Standard library only; reads files, signals nothing, never touches the run's processes otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path

TICK_NS = 1_000_000_000 // (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


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
    """Reads, and sums per arm, the CPU of every thread of the given processes. `pids` maps rank to pid."""

    def __init__(self, pids: dict[int, int], proc_root: str | os.PathLike = "/proc"):
        self.pids, self.root = dict(pids), Path(proc_root)
        self.sums: dict[str, dict] = {"on": {}, "off": {}}   # arm -> (rank, tid) -> [cpu ns, wait ns]
        self.steps = {"on": 0, "off": 0}
        self.comm: dict[tuple[int, int], str] = {}

    def read(self) -> dict[tuple[int, int], tuple[int, int]]:
        """{(rank, tid): (cpu ns, wait ns)} now, for every readable thread of every process."""
        out = {}
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
        """One phase's growth per thread (threads in both readings only) and rank 0's steps in it."""
        sums = self.sums[arm]
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
        """Per thread: on and off CPU (and wait) in microseconds per rank-0 step, and their difference,
        largest difference first; `names` maps (rank, tid) to a Python thread name (else the kernel's)."""
        if not self.steps["on"] or not self.steps["off"]:
            return {"metric": "cpu_us_per_step", "threads": []}
        rows = []
        for key in set(self.sums["on"]) | set(self.sums["off"]):
            on = [v / 1e3 / self.steps["on"] for v in self.sums["on"].get(key, (0, 0))]
            off = [v / 1e3 / self.steps["off"] for v in self.sums["off"].get(key, (0, 0))]
            rows.append({"rank": key[0], "tid": key[1], "name": (names or {}).get(key) or self.name_of(*key),
                         "on_cpu_us": round(on[0], 2), "off_cpu_us": round(off[0], 2),
                         "diff_cpu_us": round(on[0] - off[0], 2), "on_wait_us": round(on[1], 2),
                         "off_wait_us": round(off[1], 2)})
        rows.sort(key=lambda r: (-abs(r["diff_cpu_us"]), -r["on_cpu_us"]))
        return {"metric": "cpu_us_per_step", "steps": dict(self.steps), "threads": rows}


class NullTaskCpu:
    """No per-thread reading: measure()'s default, for callers that want the phases alone (tests)."""

    def read(self) -> dict:
        return {}

    def add(self, arm, before, after, steps) -> None:
        pass

    def summary(self, names=None) -> dict:
        return {"metric": "cpu_us_per_step", "threads": []}
