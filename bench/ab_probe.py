"""A probe for bench/ab_profile.py runs: `--probe CMD` runs a shell command against one rank of every
measured run, `--probe-after-s` seconds after its launch, and records how much CPU each thread of
that rank used while the command ran (from /proc, so the `--no-profile` arm has the figure too), and
where its memory sits (pages per NUMA node, /proc/PID/numa_maps, read when the command ended).

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
import threading
import time
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_OURS = ("(profiler/", "(exporters/")
# profiler.nonfinite helpers the trainer calls for its own work in both arms (the payload's
# fingerprint, the guarded optimizer step): not the profiler's cost.
_TRAINER_HELPERS = ("fingerprint (profiler/", "fingerprint_flags (profiler/", "step_unless (profiler/")


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (comm, user + system CPU seconds)} of every thread of `pid` now ({} once it ended)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue   # the thread just ended
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / _TICKS_PER_S)   # utime, stime
    return out


def cpu_delta(before: dict, after: dict, pid: int) -> dict[str, float]:
    """CPU seconds per thread between two thread_cpu_seconds() readings, keyed `main` (the process's
    first thread) or `comm/tid`; threads seen only in `after` count from 0."""
    out = {}
    for tid, (comm, cpu_s) in after.items():
        used = cpu_s - before.get(tid, (comm, 0.0))[1]
        out["main" if tid == pid else f"{comm}/{tid}"] = round(used, 3)
    return out


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
        before, t0 = thread_cpu_seconds(pid), time.monotonic()
        self._proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = self._proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        window_s = time.monotonic() - t0
        self.result = {"ran": True, "pid": pid, "command": cmd, "exit": self._proc.returncode,
                       "window_s": round(window_s, 3), "stderr_tail": (err or "")[-500:],
                       "thread_cpu_s": cpu_delta(before, thread_cpu_seconds(pid), pid),
                       "numa_pages": numa_pages(pid)}
        files = sorted(self.out_prefix.parent.glob(self.out_prefix.name + ".*.txt"))
        stacks = {f.name: main_thread_share(f) for f in files}
        self.result["main_thread_samples"] = {name: share for name, share in stacks.items() if share}
