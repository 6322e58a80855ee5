"""Python stacks through py-spy (standard library only): one `py-spy dump --json` of a pid, and the in-run
stack sampler. A runner (`PySpy`, or a test's) is `runner(pid, native=False, nonblocking=False)` -> py-spy's
JSON thread objects, or StackError with a `kind` and a one-line message.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

logger = logging.getLogger("profiler")

NO_SUCH_PID, NOT_PERMITTED, PYSPY_MISSING, NOT_PYTHON, FAILED = (
    "no_such_pid", "not_permitted", "pyspy_missing", "not_python", "failed")
TOP_FRAMES = 5
STACKS_PER_THREAD = 16
"""Whole stacks kept per thread per interval: the most common ones; the rest only counted (`other_samples`)."""
MAX_STACK_DEPTH = 128
"""Frames kept of a stack, the innermost ones; a deeper stack's outer frames become one OUTER_FRAMES frame."""
OUTER_FRAMES = "(outer frames left out)"
YAMA_PATH = "/proc/sys/kernel/yama/ptrace_scope"


class StackError(Exception):
    """A dump that could not be taken; `kind` is one of the constants above."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def find_pyspy() -> str | None:
    """py-spy beside this interpreter (a virtualenv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def ptrace_hint(pid: int, yama_path: str = YAMA_PATH) -> str:
    """How to allow tracing, with this machine's Yama setting when there is one."""
    try:
        scope = f"kernel.yama.ptrace_scope is {Path(yama_path).read_text().strip()} here"
    except OSError:
        scope = "no Yama ptrace_scope on this kernel"
    return (f"not permitted to trace pid {pid}: run as the same user as the process or as root; in a "
            f"container add the SYS_PTRACE capability (docker run --cap-add SYS_PTRACE); with "
            f"kernel.yama.ptrace_scope >= 1 run as root or `sysctl kernel.yama.ptrace_scope=0` ({scope})")


def classify_failure(pid: int, stderr: str) -> StackError:
    """A failed py-spy run's stderr -> StackError with a one-line reason."""
    text = stderr.lower()
    if "permission denied" in text or "operation not permitted" in text or "(os error 1)" in text:
        return StackError(NOT_PERMITTED, ptrace_hint(pid))
    if "failed to find python version" in text or "failed to find a python interpreter" in text:
        return StackError(NOT_PYTHON, f"pid {pid} is not a Python process (py-spy found no interpreter in it)")
    if "check that the process is running" in text or "no such process" in text:
        return StackError(NO_SUCH_PID, f"no such pid {pid}")
    first = next((line.strip() for line in stderr.splitlines() if line.strip()), "no message")
    return StackError(FAILED, f"py-spy dump of pid {pid} failed: {first}")


class PySpy:
    """The real runner: `py-spy dump --pid P --json [--native] [--nonblocking]` as a subprocess."""

    def __init__(self, executable: str | None = None, timeout_s: float = 30.0, run=subprocess.run):
        self.executable = executable or find_pyspy()
        self.timeout_s = timeout_s
        self._run = run

    def __call__(self, pid: int, native: bool = False, nonblocking: bool = False) -> list:
        if self.executable is None:
            raise StackError(PYSPY_MISSING, f"py-spy not found (looked beside {sys.executable} and on PATH); "
                                            "install it with `pip install py-spy`")
        argv = [self.executable, "dump", "--pid", str(int(pid)), "--json"]
        argv += ["--native"] * native + ["--nonblocking"] * nonblocking
        try:
            done = self._run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        except FileNotFoundError:
            raise StackError(PYSPY_MISSING, f"py-spy not found at {self.executable}; "
                                            "install it with `pip install py-spy`") from None
        except subprocess.TimeoutExpired:
            raise StackError(FAILED, f"py-spy dump of pid {pid} took over {self.timeout_s:g} s") from None
        if done.returncode != 0:
            raise classify_failure(pid, done.stderr)
        try:
            return json.loads(done.stdout)
        except ValueError as exc:
            raise StackError(FAILED, f"py-spy dump of pid {pid} printed no JSON: {exc}") from None


def frame_label(frame: dict) -> str:
    """`func (file.py:123)`: py-spy's function name, short file name and line."""
    where = frame.get("short_filename") or frame.get("filename") or "?"
    return f"{frame.get('name', '?')} ({where}:{frame.get('line', '?')})"


def read_threads(raw: list) -> list[dict]:
    """py-spy thread objects -> [{"name", "native_id", "active", "owns_gil", "frames"}], frames as
    labels, innermost first (py-spy's order)."""
    return [{"name": t.get("thread_name") or f"thread {t.get('os_thread_id')}",
             "native_id": t.get("os_thread_id"), "active": bool(t.get("active")),
             "owns_gil": bool(t.get("owns_gil")), "frames": [frame_label(f) for f in t.get("frames") or []]}
            for t in raw]


def whole_stack(frames: list) -> tuple:
    """A thread's frames (innermost first, as read_threads gives them) as its stack root -> leaf, at most
    MAX_STACK_DEPTH frames: the innermost, under one OUTER_FRAMES frame where there were more."""
    if len(frames) <= MAX_STACK_DEPTH:
        return tuple(reversed(frames))
    return (OUTER_FRAMES, *reversed(frames[:MAX_STACK_DEPTH - 1]))


class _ThreadCounts:
    __slots__ = ("name", "samples", "idle", "hot", "stacks", "idle_stacks")

    def __init__(self, name: str):
        self.name, self.samples, self.idle, self.hot = name, 0, 0, Counter()
        self.stacks, self.idle_stacks = Counter(), Counter()   # whole stack -> samples, and those of them idle

    def count(self, frames: list, active: bool) -> None:
        """One sample of the thread: `frames` innermost first, `active` as py-spy saw it."""
        self.samples += 1
        stack = whole_stack(frames)
        self.stacks[stack] += 1
        if active and frames:
            self.hot[frames[0]] += 1
        else:
            self.idle += 1
            self.idle_stacks[stack] += 1

    def summary(self, native_id, frame_index: dict) -> dict:
        """The thread's entry of an interval's stack_samples; its kept stacks' frames interned in `frame_index`
        ({label: index}, the interval's `frames` table)."""
        kept = self.stacks.most_common(STACKS_PER_THREAD)
        stacks = [{"frames": [frame_index.setdefault(f, len(frame_index)) for f in stack], "count": n,
                   "idle_samples": self.idle_stacks[stack]} for stack, n in kept]
        other = self.samples - sum(n for _, n in kept)
        other_idle = self.idle - sum(e["idle_samples"] for e in stacks)
        return {"name": self.name, "native_id": native_id, "samples": self.samples, "idle_samples": self.idle,
                "top_frames": [{"frame": f, "count": n} for f, n in self.hot.most_common(TOP_FRAMES)],
                "stacks": stacks, "other_samples": other, "other_idle_samples": other_idle}


class StackSampler:
    """Takes `samples_per_interval` non-blocking py-spy dumps of `pid` (its own process) every `interval_s`,
    evenly spread, from a daemon thread. A thread's innermost frame counts as hot when py-spy reports the
    thread active (on a CPU), else the sample counts as idle. Each sample's whole stack (root -> leaf, at most
    MAX_STACK_DEPTH frames) is counted too; an interval keeps each thread's STACKS_PER_THREAD most common stacks
    and counts the rest in `other_samples`, so a thread's stacks' counts plus `other_samples` are its samples
    (and their `idle_samples` plus `other_idle_samples` its idle samples). A failing dump is logged once and
    counted."""

    def __init__(self, pid: int, samples_per_interval: int, interval_s: float, runner=None):
        if not isinstance(samples_per_interval, int) or samples_per_interval < 1:
            raise ValueError(f"StackSampler: samples_per_interval must be an int >= 1, got {samples_per_interval!r}")
        if not interval_s > 0:
            raise ValueError(f"StackSampler: interval_s must be > 0, got {interval_s!r}")
        self.pid = int(pid)
        self.period_s = float(interval_s) / samples_per_interval
        self._runner = runner or PySpy(timeout_s=max(10.0, self.period_s))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = False
        self._reset()

    def _reset(self) -> None:
        self._taken, self._failed, self._error = 0, 0, None
        self._threads: dict = {}

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="profiler.stacks", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 15.0)
            self._thread = None

    def _run(self) -> None:
        """Sample at start + (i + 1/2) * period; slots missed behind a slow dump are skipped."""
        start_s = time.monotonic()
        slot = 0
        while True:
            due_s = start_s + (slot + 0.5) * self.period_s
            if self._stop.wait(max(0.0, due_s - time.monotonic())):
                return
            self.sample_once()
            slot = max(slot + 1, int((time.monotonic() - start_s) / self.period_s + 0.5))

    def _dump(self) -> list:
        """A non-blocking dump can catch the thread list mid-change ("Failed to get stack traces"): such a
        failure is retried once at once; the other kinds would fail again."""
        try:
            return self._runner(self.pid, native=False, nonblocking=True)
        except StackError as exc:
            if exc.kind != FAILED:
                raise
        return self._runner(self.pid, native=False, nonblocking=True)

    def sample_once(self) -> bool:
        """One dump counted into the current interval; False (logged once) when it failed."""
        try:
            threads = read_threads(self._dump())
        except Exception as exc:  # noqa: BLE001 - StackError or anything else: counted, never raised
            message = str(exc) if isinstance(exc, StackError) else f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._failed += 1
                self._error = message
            if not self._logged:
                self._logged = True
                logger.warning("stack sampling: %s (logged once; later failures are only counted)", message)
            return False
        with self._lock:
            self._taken += 1
            for t in threads:
                counts = self._threads.setdefault(t["native_id"], _ThreadCounts(t["name"]))
                counts.name = t["name"]
                counts.count(t["frames"], t["active"])
        return True

    def interval_summary(self) -> dict:
        """{"samples", "failed", "frames", "threads": [{"name", "native_id", "samples", "idle_samples", "top_frames",
        "stacks": [{"frames", "count", "idle_samples"}], "other_samples", "other_idle_samples"}]} since the last call
        (+ "error": the last failure), and a reset. A stack's `frames` index the interval's `frames` labels, root
        first (docs/RUNLOG.md)."""
        with self._lock:
            frame_index: dict = {}
            threads = [c.summary(native_id, frame_index) for native_id, c in self._threads.items()]
            summary = {"samples": self._taken, "failed": self._failed, "frames": list(frame_index),
                       "threads": threads}
            if self._error is not None:
                summary["error"] = self._error
            self._reset()
        return summary


class NullStackSampler:
    """Stands in for StackSampler when samples_per_interval is 0."""

    def start(self) -> None:
        pass

    stop = start

    def interval_summary(self) -> None:
        return None


def make_stack_sampler(pid: int, samples_per_interval: int, interval_s: float):
    """StackSampler for K >= 1, NullStackSampler for K = 0."""
    if samples_per_interval == 0:
        return NullStackSampler()
    return StackSampler(pid, samples_per_interval, interval_s)
