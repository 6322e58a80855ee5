"""profiler/taskcpu.py: per-thread CPU of the run's processes around each overhead phase, from a scripted
/proc tree (schedstat, the stat fallback, a thread that ends) and from this process's real /proc."""
import os
import threading
import time

import pytest

from profiler.overhead import format_result, measure
from profiler.taskcpu import TICK_NS, TaskCpu
from tests.profiler.test_overhead_measure import ScriptedRun


def write_task(root, pid, tid, cpu_ns=None, wait_ns=0, ticks=None, comm=None):
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    if comm is not None or not (task / "comm").exists():
        (task / "comm").write_text((comm or "python3") + "\n")
    if cpu_ns is not None:
        (task / "schedstat").write_text(f"{cpu_ns} {wait_ns} 7\n")
    if ticks is not None:   # fields 14, 15 (utime, stime) after "(comm)", which may hold spaces and parens
        (task / "stat").write_text(f"{tid} (a (b) c) S " + " ".join(["0"] * 10) + f" {ticks[0]} {ticks[1]} 0 0\n")
    return task


def test_growth_per_arm_in_microseconds_per_rank0_step(tmp_path):
    write_task(tmp_path, 100, 100, cpu_ns=1_000_000, wait_ns=0, comm="pt_main_thread")
    write_task(tmp_path, 100, 101, cpu_ns=0)
    write_task(tmp_path, 200, 200, ticks=(5, 5))             # no schedstat: ticks serve
    ticks = iter(range(0, 10**10, 5_000_000))   # each reading 5 ms after the last
    probe = TaskCpu({0: 100, 1: 200}, proc_root=tmp_path, clock_ns=lambda: next(ticks))
    before = probe.read()
    assert before == {(0, 100): (1_000_000, 0), (0, 101): (0, 0), (1, 200): (10 * TICK_NS, 0)}
    write_task(tmp_path, 100, 100, cpu_ns=3_000_000, wait_ns=400_000)
    write_task(tmp_path, 100, 101, cpu_ns=500_000)
    write_task(tmp_path, 200, 200, ticks=(6, 5))
    probe.add("on", before, probe.read(), steps=10)           # 2 ms of thread 100 over 10 steps: 200 us a step
    before = probe.read()
    write_task(tmp_path, 100, 100, cpu_ns=4_000_000)
    (tmp_path / "100" / "task" / "101" / "schedstat").unlink()   # the thread ended: counted up to its last reading
    (tmp_path / "100" / "task" / "101" / "comm").unlink()
    probe.add("off", before, probe.read(), steps=10)
    out = probe.summary({(0, 101): "profiler.collector"})
    assert out["steps"] == {"on": 10, "off": 10} and out["wall_seconds"] == {"on": 0.005, "off": 0.005}
    rows = {(r["rank"], r["tid"]): r for r in out["threads"]}
    assert rows[(0, 100)] == {"rank": 0, "tid": 100, "name": "pt_main_thread", "on_cpu_us": 200.0,
                              "off_cpu_us": 100.0, "diff_cpu_us": 100.0, "on_wait_us": 40.0, "off_wait_us": 0.0,
                              "on_busy_pct": 40.0, "off_busy_pct": 20.0}   # 2 ms and 1 ms of CPU in 5 ms
    assert rows[(0, 101)]["name"] == "profiler.collector" and rows[(0, 101)]["off_cpu_us"] == 0.0
    assert rows[(1, 200)]["on_cpu_us"] == pytest.approx(TICK_NS / 1e3 / 10)
    assert [r["tid"] for r in out["threads"]] == [200, 100, 101]   # one tick a phase is 1,000 us a step here


def test_a_process_gone_or_never_there_reads_as_nothing(tmp_path):
    probe = TaskCpu({0: 999999}, proc_root=tmp_path)
    assert probe.read() == {} and probe.summary() == {"metric": "cpu_us_per_step", "threads": []}


def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_this_process_real_threads_show_where_the_cpu_went():
    """Real /proc: a thread that spins only in the "on" phases is the thread with the difference."""
    go, done, stop = threading.Event(), threading.Event(), threading.Event()

    def worker():
        while not stop.is_set():
            if go.wait(0.01):
                burn(0.05)
                go.clear()
                done.set()
    t = threading.Thread(target=worker, name="burner")
    t.start()
    try:
        probe = TaskCpu({0: os.getpid()})
        for arm in ("on", "off", "off", "on"):
            before = probe.read()
            if arm == "on":
                done.clear()
                go.set()
                assert done.wait(10)
            else:
                time.sleep(0.05)   # an off phase as long, the burner idle
            probe.add(arm, before, probe.read(), steps=5)
    finally:
        stop.set()
        t.join()
    row = next(r for r in probe.summary({(0, t.native_id): "burner"})["threads"] if r["name"] == "burner")
    assert row["on_cpu_us"] >= 0.04 * 2 / 10 * 1e6 and row["off_cpu_us"] < 1000   # ~10 ms a step on, ~0 off
    assert row["tid"] == t.native_id
    assert row["on_busy_pct"] > 50 > row["off_busy_pct"], row   # busy through its on phases, idle in the off ones


class Probe:
    """A probe whose thread 7 spends 30 us more per step when profiling is on."""

    def __init__(self):
        self.cpu, self.added = 0, []

    def read(self):
        return {(0, 7): (self.cpu, 0)}

    def add(self, arm, before, after, steps):
        self.added.append(arm)

    def summary(self, names=None):
        return {"metric": "cpu_us_per_step", "threads": [
            {"rank": 0, "tid": 7, "name": names[(0, 7)], "on_cpu_us": 130.0, "off_cpu_us": 100.0,
             "diff_cpu_us": 30.0, "on_wait_us": 1.0, "off_wait_us": 2.0, "on_busy_pct": 65.0, "off_busy_pct": 64.0}]}


def test_the_overhead_result_carries_and_prints_the_threads_table():
    run, probe = ScriptedRun({"on": 9.9, "off": 10.0}), Probe()
    run.thread_names = lambda: {(0, 7): "drafter.main"}
    result = measure(run, pairs=2, settle_s=0.5, measure_s=3.0, sleep=run.sleep, probe=probe)
    assert probe.added == ["on", "off", "off", "on"] and result["threads_cpu"]["threads"][0]["name"] == "drafter.main"
    text = format_result({**result, "run_dir": "/r", "ranks": 2})
    assert "CPU per rank-0 step (us; /proc schedstat) and busy share (CPU / wall)" in text
    assert text.splitlines()[-1].split() == ["0", "drafter.main", "130.0", "100.0", "+30.0", "1.0", "2.0", "65.0%",
                                             "64.0%"]
    old_row = {k: v for k, v in result["threads_cpu"]["threads"][0].items() if "busy" not in k}   # a result from before
    text = format_result({**result, "run_dir": "/r", "ranks": 2, "threads_cpu": {"threads": [old_row]}})
    assert text.splitlines()[-1].split()[-2:] == ["-", "-"]
