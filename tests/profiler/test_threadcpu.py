"""Per-thread CPU time per interval: real threads on their real clocks, and the profiler's share."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from exporters.console import format_interval
from profiler.threadcpu import ThreadCpu, profiler_share
from tests.profiler.build import make_profiler


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_thread_shows_its_cpu_and_a_sleeping_one_none():
    """Compared with what each thread measured of itself in this test, not with wall time: on a busy machine (load
    15: two extra spinning processes on 2 cores) 0.2 s of CPU took more than the 0.35 s the test used to wait, and
    `0.15 <= 0.1178` failed though the accumulator was right. A reader of the wrong clock (the process's, a wall
    clock), of another thread's, or of none still fails: the idle thread would show the busy one's CPU or none."""
    acc = ThreadCpu()
    burnt, read = threading.Event(), threading.Event()
    own = {}

    def busy_then_sleep():
        _burn(0.2)
        own["burnt_s"] = time.thread_time()
        burnt.set()
        read.wait(30)
        own["end_s"] = time.thread_time()

    def idle_then_sleep():
        read.wait(30)
        own["idle_s"] = time.thread_time()

    busy = threading.Thread(target=busy_then_sleep, name="profiler.test-busy")
    idle = threading.Thread(target=idle_then_sleep, name="test-idle")
    for t in (busy, idle):
        t.start()
    assert burnt.wait(60)     # burnt, now asleep: both alive when read
    cpu = acc.take()
    read.set()
    for t in (busy, idle):
        t.join()
    # The accumulator's figure lies between the busy thread's own clock when it had burnt and when it ended
    # (1 ms of slack for clock granularity), and the idle thread's is its own clock, far below the busy one's.
    assert own["burnt_s"] - 0.001 <= cpu["profiler.test-busy"] <= own["end_s"] + 0.001, (cpu, own)
    assert cpu["test-idle"] <= own["idle_s"] + 0.001 and cpu["test-idle"] < cpu["profiler.test-busy"] / 4, (cpu, own)
    assert list(cpu)[0] == "profiler.test-busy"   # most first
    assert profiler_share(cpu, 1.0) >= own["burnt_s"] - 0.001 and profiler_share(cpu, 0.0) is None


def test_names_are_summed_unreadable_clocks_skipped_and_deltas_never_negative():
    clocks = {1: 10**9, 2: 2 * 10**9, 3: None, 4: 5 * 10**9}
    threads = [SimpleNamespace(native_id=1, name="w"), SimpleNamespace(native_id=2, name="w"),
               SimpleNamespace(native_id=3, name="gone"), SimpleNamespace(native_id=None, name="unstarted"),
               SimpleNamespace(native_id=4, name="profiler.collector")]
    acc = ThreadCpu(threads=lambda: threads, cpu_ns=clocks.get)
    clocks.update({1: 1.5 * 10**9, 2: 2.5 * 10**9, 4: 5.25 * 10**9})
    assert acc.take() == {"w": 1.0, "profiler.collector": 0.25}
    clocks[4] = 10**9                          # a reused thread id with a younger clock: 0, not negative
    assert acc.take()["profiler.collector"] == 0.0
    assert profiler_share({"w": 1.0, "profiler.collector": 0.25, "profiler.nvml": 0.25}, 5.0) == 0.1


def test_every_interval_says_where_the_cpu_went(tmp_path):
    with make_profiler(tmp_path, background=False) as prof:
        _burn(0.1)
        rec = prof.close_interval()
    cpu = rec["threads_cpu_seconds"]
    assert cpu[threading.current_thread().name] >= 0.08
    assert rec["profiler_share"] is not None and 0.0 <= rec["profiler_share"] < 0.5
    assert "  thread cpu: " + threading.current_thread().name in format_interval(rec)


def test_the_clock_of_a_thread_that_has_exited_is_none_not_a_crash():
    from profiler.threadcpu import _cpu_ns

    t = threading.Thread(target=_burn, args=(0.05,))
    t.start()
    t.join()        # returns just before the kernel thread exits: give it a moment
    deadline = time.monotonic() + 5
    while _cpu_ns(t.native_id) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _cpu_ns(t.native_id) is None
    assert 0 < _cpu_ns(threading.get_native_id()) <= time.thread_time_ns() + 10**6
