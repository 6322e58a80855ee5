"""CPU time of this process's threads per interval (Linux's per-thread clock by native id, one syscall per
thread, read at each interval close): where the process's CPU went, and what the profiler's threads cost.
"""

from __future__ import annotations

import threading
import time

PROFILER_PREFIXES = ("profiler.", "metrics.http", "dflash-otel", "Otel")
"""Thread names of the profiler and its exporters: every thread the profiler starts is `profiler.<part>`
(collector, exporter, nvml, stacks, control, watchdog, signal_watch, signal_grace), the Prometheus endpoint's is
`metrics.http`, and the OpenTelemetry exporter's and SDK's are `dflash-otel-close`, `OtelBatch...` and
`OtelPeriodicExportingMetricReader`."""


def is_profiler_thread(name) -> bool:
    """Whether a thread of that name is the profiler's or one of its exporters' (PROFILER_PREFIXES): what the
    profiler's CPU share counts, and what hot frames and snapshots show apart from the training's own threads."""
    return isinstance(name, str) and name.startswith(PROFILER_PREFIXES)


def _cpu_ns(native_id: int) -> int | None:
    """The CPU time of kernel thread `native_id`, or None where it cannot be read (ended, or not Linux). The clock
    id is glibc's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED): an exited thread gives EINVAL, where
    pthread_getcpuclockid() on a finished Python thread would read freed memory."""
    try:
        return time.clock_gettime_ns(((~native_id) << 3) | 6)
    except (OSError, OverflowError, AttributeError):
        return None


class ThreadCpu:
    """Per-thread CPU time since the last `take()`. `threads` and `cpu_ns` are injectable for tests."""

    def __init__(self, threads=threading.enumerate, cpu_ns=_cpu_ns):
        self._threads, self._cpu_ns = threads, cpu_ns
        self._last: dict[int, int] = {}
        self.take()   # the baseline: the first interval counts from the profiler's start

    def take(self) -> dict[str, float]:
        """{thread name: CPU seconds since the previous take}, names sorted by CPU, most first."""
        now: dict[int, int] = {}
        by_name: dict[str, int] = {}
        for t in self._threads():
            tid = getattr(t, "native_id", None)   # None: not started yet
            ns = self._cpu_ns(tid) if tid is not None else None
            if ns is None:
                continue
            now[tid] = ns
            by_name[t.name] = by_name.get(t.name, 0) + max(0, ns - self._last.get(tid, 0))
        self._last = now
        return {n: round(v / 1e9, 6) for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])}


def profiler_share(threads_cpu_seconds: dict, duration_seconds: float) -> float | None:
    """The profiler's and its exporters' threads' CPU seconds over the interval's wall seconds (None if empty)."""
    if not duration_seconds or duration_seconds <= 0:
        return None
    own = sum(v for n, v in threads_cpu_seconds.items() if is_profiler_thread(n))
    return own / duration_seconds


def threads_section(native_ids: dict):
    """fn(duration_s) -> the interval record's "threads" (`native_ids`: the span-recording threads' names and OS
    ids), "threads_cpu_seconds" and "profiler_share", the CPU counted from this call on."""
    thread_cpu = ThreadCpu()

    def section(duration_s: float) -> dict:
        cpu = thread_cpu.take()
        return {"threads": [{"name": n, "native_id": t} for n, t in sorted(native_ids.items())],
                "threads_cpu_seconds": cpu, "profiler_share": profiler_share(cpu, duration_s)}
    return section
