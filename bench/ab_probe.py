"""A probe for bench/ab_profile.py runs: `--probe CMD` runs a shell command against one rank of every
measured run, `--probe-after-s` seconds after its launch, and records how much CPU each thread of
that rank used while the command ran (from /proc, so the `--no-profile` arm has the figure too),
where its memory sits (pages per NUMA node, /proc/PID/numa_maps, read when the command ended), how
much of its CPUs' time the hypervisor took (steal, /proc/stat), and where its two busiest threads ran
(sampled every PLACEMENT_EVERY_S): how often they shared one physical core (the same CPU or two
hyperthread siblings), another way a whole run can land in a slow mode.

In CMD, `{pid}` is the rank's process id and `{out}` a path prefix beside the run's log
(RUN_DIR.probe), so what the command writes outlives the run's tidy-up. Made to find what
`--no-profile` changes besides the profiler, e.g. py-spy on both arms:

    --probe 'py-spy record --pid {pid} --nonblocking --idle --threads --rate 100 --duration 10
             --format raw -o {out}.idle.txt'

Each `{out}.*.txt` the command leaves in py-spy's raw (collapsed) format is also read back: how many
of the training thread's samples (a thread named `*.main`) were inside the profiler's code. That is
the profiler's cost on that thread measured inside one run, so the per-run speed of the host (runs of
the launch-bound workload land in modes +-15% apart in either arm: bench/RESULTS.md) does not enter it.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PLACEMENT_EVERY_S = 0.1
_OURS = ("(profiler/", "(exporters/")
# profiler.nonfinite helpers the trainer calls for its own work in both arms (the payload's
# fingerprint, the guarded optimizer step): not the profiler's cost.
_TRAINER_HELPERS = ("fingerprint (profiler/", "fingerprint_flags (profiler/", "step_unless (profiler/")


def _thread_stats(pid: int):
    """(tid, comm, the stat fields after comm) of every thread of `pid` now (none once it ended)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue   # the thread just ended
        yield int(tid), stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (comm, user + system CPU seconds)} of every thread of `pid` now ({} once it ended)."""
    return {tid: (comm, (int(f[11]) + int(f[12])) / _TICKS_PER_S)   # utime + stime
            for tid, comm, f in _thread_stats(pid)}


def cpu_delta(before: dict, after: dict, pid: int) -> dict[str, float]:
    """CPU seconds per thread between two thread_cpu_seconds() readings, keyed `main` (the process's
    first thread) or `comm/tid`; threads seen only in `after` count from 0."""
    out = {}
    for tid, (comm, cpu_s) in after.items():
        used = cpu_s - before.get(tid, (comm, 0.0))[1]
        out["main" if tid == pid else f"{comm}/{tid}"] = round(used, 3)
    return out


def thread_cpus(pid: int) -> dict[int, int]:
    """{tid: the CPU it last ran on} for every thread of `pid` now (/proc/PID/task/TID/stat `processor`)."""
    return {tid: int(f[36]) for tid, _, f in _thread_stats(pid) if len(f) > 36}


def siblings(cpu: int, sysfs: Path = Path("/sys/devices/system/cpu")) -> frozenset:
    """The CPUs of `cpu`'s physical core (itself and its hyperthread siblings), from sysfs."""
    try:
        return frozenset(parse_cpu_list((sysfs / f"cpu{cpu}/topology/thread_siblings_list").read_text()))
    except (OSError, ValueError):
        return frozenset([cpu])


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def same_core_share(samples: list, a: int, b: int, core=siblings) -> dict:
    """How often threads `a` and `b` were last on one physical core, over placement samples
    ([{tid: cpu}]) holding both: {"samples": n, "same_core": k}."""
    n = k = 0
    for placed in samples:
        if a in placed and b in placed:
            n += 1
            k += placed[b] in core(placed[a])
    return {"samples": n, "same_core": k}


def steal_ticks(stat: Path = Path("/proc/stat")) -> dict[int, tuple[int, int]]:
    """{cpu: (steal ticks, all ticks)} from /proc/stat's per-CPU lines ({} when unreadable)."""
    out = {}
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *ticks = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and len(ticks) >= 8:
            values = [int(t) for t in ticks[:8]]   # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (values[7], sum(values))
    return out


def steal_share(before: dict, after: dict, cpus) -> float | None:
    """The share of `cpus`' ticks between two steal_ticks() readings that the hypervisor took."""
    stolen = sum(after[c][0] - before[c][0] for c in cpus if c in before and c in after)
    ticks = sum(after[c][1] - before[c][1] for c in cpus if c in before and c in after)
    return round(stolen / ticks, 5) if ticks > 0 else None


def numa_pages(pid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """Resident pages of `pid` per NUMA node ({"N0": pages, ...}) from /proc/PID/numa_maps; {} when it
    cannot be read. On a host with several nodes, a run whose memory sits on another node than its CPUs
    runs slower for its whole life: one suspect for the launch workload's per-run speed modes."""
    pages: dict[str, int] = {}
    try:
        text = (proc / str(pid) / "numa_maps").read_text()
    except OSError:
        return pages
    for word in text.split():
        node, eq, count = word.partition("=")
        if eq and node[:1] == "N" and node[1:].isdigit() and count.isdigit():
            pages[node] = pages.get(node, 0) + int(count)
    return pages


def numa_nodes(sysfs: Path = Path("/sys/devices/system/node")) -> dict[str, str]:
    """{"node0": "0-7", ...}: this machine's NUMA nodes and their CPUs, as the kernel lists them."""
    nodes = {}
    for d in sorted(sysfs.glob("node[0-9]*"), key=lambda d: int(d.name[4:])):
        try:
            nodes[d.name] = (d / "cpulist").read_text().strip()
        except OSError:
            continue
    return nodes


def main_thread_share(path: Path) -> dict | None:
    """Samples of the `*.main` thread(s) in a py-spy raw file, and how many had a frame of the profiler
    or the exporters in them (the trainer's own helpers aside); None when the file is not that format."""
    samples = inside = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            return None
        frames = stack.split(";")
        if not frames[0].startswith("thread (") or not frames[0].endswith(".main"):
            continue
        samples += int(count)
        first = next((f for f in frames[1:] if any(mark in f for mark in _OURS)), None)
        if first is not None and not first.startswith(_TRAINER_HELPERS):
            inside += int(count)
    return {"samples": samples, "profiler": inside} if samples else None


class Probe:
    """Runs `template` once against the rank `find_pid()` returns, `after_s` after construction; the
    outcome (command, exit code, window, CPU per thread) is in `.result` once `stop()` returned."""

    def __init__(self, template: str, out_prefix: Path, find_pid, after_s: float, timeout_s: float = 120.0):
        self.template, self.out_prefix, self.find_pid = template, out_prefix, find_pid
        self.after_s, self.timeout_s = after_s, timeout_s
        self.result: dict = {"ran": False}
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ab.probe", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        """The run ended: end a command still running, wait for the thread, return the result."""
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
        self._thread.join(timeout=10.0)
        return self.result

    def _run(self) -> None:
        if self._stop.wait(self.after_s):
            return
        pid = self.find_pid()
        if pid is None:
            self.result = {"ran": False, "why": "rank not found"}
            return
        cmd = self.template.format(pid=pid, out=shlex.quote(str(self.out_prefix)))
        before, steal0, t0 = thread_cpu_seconds(pid), steal_ticks(), time.monotonic()
        err, placement = self._watch(cmd, pid)
        window_s = time.monotonic() - t0
        after = thread_cpu_seconds(pid)
        self.result = {"ran": True, "pid": pid, "command": cmd, "exit": self._proc.returncode,
                       "window_s": round(window_s, 3), "stderr_tail": err[-500:],
                       "thread_cpu_s": cpu_delta(before, after, pid), "numa_pages": numa_pages(pid),
                       "steal_share": steal_share(steal0, steal_ticks(), _affinity(pid)),
                       "busiest_threads": _busiest_pair(before, after, pid, placement)}
        files = sorted(self.out_prefix.parent.glob(self.out_prefix.name + ".*.txt"))
        stacks = {f.name: main_thread_share(f) for f in files}
        self.result["main_thread_samples"] = {name: share for name, share in stacks.items() if share}

    def _watch(self, cmd: str, pid: int) -> tuple[str, list]:
        """Run `cmd` to its end (killed after timeout_s), sampling where `pid`'s threads run every
        PLACEMENT_EVERY_S meanwhile; returns its stderr and the samples."""
        placement = []
        deadline = time.monotonic() + self.timeout_s
        with tempfile.TemporaryFile("w+", errors="replace") as err:
            self._proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.DEVNULL, stderr=err)
            while self._proc.poll() is None:
                if time.monotonic() > deadline:
                    self._proc.kill()
                    self._proc.wait()
                    break
                placement.append(thread_cpus(pid))
                time.sleep(PLACEMENT_EVERY_S)
            err.seek(0)
            return err.read(), placement


def _affinity(pid: int) -> list[int]:
    """The CPUs `pid` may run on (every CPU when it ended)."""
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return list(range(os.cpu_count() or 1))


def _busiest_pair(before: dict, after: dict, pid: int, placement: list) -> dict | None:
    """The two threads that used the most CPU in the window, their CPU seconds, and how often the
    placement samples found them on one physical core; None with fewer than two threads."""
    used = sorted(((cpu_s - before.get(tid, (comm, 0.0))[1], tid, comm) for tid, (comm, cpu_s) in after.items()),
                  reverse=True)
    if len(used) < 2:
        return None
    names = ["main" if tid == pid else f"{comm}/{tid}" for _, tid, comm in used[:2]]   # cpu_delta's keys
    return {"threads": names, "cpu_s": [round(u[0], 3) for u in used[:2]],
            **same_core_share(placement, used[0][1], used[1][1])}
