"""bench/ab_probe.py (the A/B's probe): the per-thread CPU window and the py-spy sample share, against
real processes and the real py-spy; and the summary lines ab_profile prints from them."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))
import ab_probe  # noqa: E402

_spec = importlib.util.spec_from_file_location("ab_profile", _BENCH / "ab_profile.py")
ab = sys.modules["ab_profile"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)

# A training thread named like the trainer's, spending its time in a module under a `profiler/`
# directory (as the profiler's own code would) and in one named like a trainer-side helper.
_BUSY = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from profiler import busy
threading.current_thread().name = "drafter.main"
threading.Thread(target=lambda: [time.sleep(0.01) for _ in range(2000)], daemon=True).start()   # a 2nd thread
end = time.monotonic() + 20
while time.monotonic() < end:
    busy.spin()
"""
_MODULE = """
def spin():
    x = 0
    for i in range(20000):
        x += i
    return x
"""


@pytest.fixture
def busy_process(tmp_path):
    (tmp_path / "profiler").mkdir()
    (tmp_path / "profiler" / "__init__.py").write_text("")
    (tmp_path / "profiler" / "busy.py").write_text(_MODULE)
    proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(tmp_path)])
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait()


def test_probe_runs_the_command_and_measures_the_threads_cpu(busy_process, tmp_path):
    prefix = tmp_path / "run.probe"
    probe = ab_probe.Probe("sleep 0.5; cat /proc/{pid}/status > {out}.status", prefix,
                           lambda: busy_process.pid, after_s=0.1)
    time.sleep(1.2)
    result = probe.stop()
    assert result["ran"] and result["exit"] == 0 and result["pid"] == busy_process.pid
    assert f"Pid:\t{busy_process.pid}" in Path(f"{prefix}.status").read_text()
    assert 0.4 <= result["window_s"] < 2.0
    assert result["thread_cpu_s"]["main"] >= 0.1   # the spinning thread: most of the window (2 loaded cores)
    assert result["numa_pages"].get("N0", 0) > 0   # where its memory sits, read when the command ended
    assert 0.0 <= result["steal_share"] <= 1.0   # of the CPUs it may run on, from /proc/stat
    pair = result["busiest_threads"]   # the spinning main thread and the sleeping one, sampled every 0.1 s
    assert pair["threads"][0] == "main" and pair["cpu_s"][0] >= pair["cpu_s"][1]
    assert 3 <= pair["samples"] <= 20 and 0 <= pair["same_core"] <= pair["samples"]


def test_probe_without_its_process_says_so(tmp_path):
    probe = ab_probe.Probe("true", tmp_path / "x.probe", lambda: None, after_s=0.0)
    time.sleep(0.2)
    assert probe.stop() == {"ran": False, "why": "rank not found"}


def test_py_spy_samples_of_the_training_thread_in_profiler_code_are_counted(busy_process, tmp_path):
    from profiler.stacks import find_pyspy

    prefix = tmp_path / "run.probe"
    probe = ab_probe.Probe(find_pyspy() + " record --pid {pid} --nonblocking --idle --threads --rate 50 --duration 1 "
                           "--format raw -o {out}.idle.txt", prefix, lambda: busy_process.pid, after_s=0.0)
    time.sleep(2.5)
    result = probe.stop()
    assert result["exit"] == 0, result["stderr_tail"]
    share = result["main_thread_samples"]["run.probe.idle.txt"]
    assert share["samples"] >= 20 and share["profiler"] >= 0.8 * share["samples"]


def test_main_thread_share_counts_only_the_training_thread_and_not_the_trainers_helpers(tmp_path):
    raw = tmp_path / "x.txt"
    raw.write_text(textwrap.dedent("""\
        thread (10): drafter.main;run (dflash/roles.py:1);span (profiler/api.py:3) 5
        thread (10): drafter.main;run (dflash/roles.py:1);fingerprint (profiler/nonfinite.py:9) 7
        thread (10): drafter.main;step (dflash/roles.py:2);step_unless (profiler/nonfinite.py:9);x (profiler/api.py:1) 2
        thread (10): drafter.main;run (dflash/roles.py:1) 86
        thread (11): profiler.collector;_run (profiler/intervals.py:3) 100
        """))
    assert ab_probe.main_thread_share(raw) == {"samples": 100, "profiler": 5}
    raw.write_text("not py-spy output\n")
    assert ab_probe.main_thread_share(raw) is None


def test_sample_notes_pool_per_arm_and_kind():
    runs = [{"arm": "on", "probe": {"main_thread_samples": {"p1-on.probe.idle.txt": {"samples": 800, "profiler": 8}}}},
            {"arm": "on", "probe": {"main_thread_samples": {"p2-on.probe.idle.txt": {"samples": 200, "profiler": 2}}}},
            {"arm": "off", "probe": {"main_thread_samples": {"p1-off.probe.idle.txt": {"samples": 1000, "profiler": 0}}}},
            {"arm": "off"}]
    lines = ab._sample_notes(runs)
    assert ab._sample_notes(runs + [{"arm": "on", "probe": {"ran": True, "exit": 127, "stderr_tail": "sh: py-spy: not found"}},
                                    {"arm": "off", "probe": {"ran": False, "why": "rank not found"}}])[0] == \
        "probe failed in 2 runs, first: exit 127 sh: py-spy: not found"
    assert lines == ["off runs (idle samples): the training thread was in profiler code in 0.00% of 1000 "
                     "(+-0.00%, 1 runs; py-spy probe)",
                     "on runs (idle samples): the training thread was in profiler code in 1.00% of 1000 "
                     "(+-0.31%, 2 runs; py-spy probe)"]


def test_numa_placement_of_a_real_process_and_of_a_two_node_machine(busy_process, tmp_path):
    """Pages per node from the live process's numa_maps (this machine: node 0 only), and from a
    hand-written two-node one; the machine's nodes from sysfs, in node order."""
    assert ab_probe.numa_pages(busy_process.pid).get("N0", 0) > 0
    assert ab_probe.numa_pages(999_999_999) == {}
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "numa_maps").write_text(
        "7f00 default anon=5 dirty=5 N0=3 N1=2 kernelpagesize_kB=4\n"
        "7f10 default file=/lib/x.so mapped=4 N1=4 kernelpagesize_kB=4\n")
    assert ab_probe.numa_pages(7, proc=tmp_path) == {"N0": 3, "N1": 6}
    for name, cpus in (("node10", "20-23"), ("node0", "0-7"), ("node2", "8-15")):
        (tmp_path / "sys" / name).mkdir(parents=True)
        (tmp_path / "sys" / name / "cpulist").write_text(cpus + "\n")
    assert list(ab_probe.numa_nodes(tmp_path / "sys").items()) == [("node0", "0-7"), ("node2", "8-15"),
                                                                   ("node10", "20-23")]
    assert ab_probe.numa_nodes() == {"node0": Path("/sys/devices/system/node/node0/cpulist").read_text().strip()}


def test_numa_lines_appear_only_when_more_than_one_node_is_involved():
    def run(pair, arm, value, pages):
        return {"pair": pair, "arm": arm, "value": value, "probe": {"ran": True, "exit": 0, "numa_pages": pages}}

    one = [run(1, "on", 40_000.0, {"N0": 100}), run(1, "off", 41_000.0, {"N0": 90})]
    assert ab._numa_notes(one) == []
    two = [run(1, "on", 40_000.0, {"N0": 75, "N1": 25}), run(1, "off", 46_000.0, {"N0": 100})]
    assert ab._numa_notes(two) == ["numa: pair 2 on 40,000: pages N0 75%, N1 25%",
                                   "numa: pair 2 off 46,000: pages N0 100%"]
    machine = {"gpus": [], "torch": None, "python": "3.12", "cpus_allowed": 16, "cpu_count": 16, "host": "h",
               "date_utc": "d", "commit": "abc", "numa_nodes": {"node0": "0-7", "node1": "8-15"}}
    assert ab.format_machine(machine).endswith("| commit abc | NUMA node0 0-7, node1 8-15")
    assert "NUMA" not in ab.format_machine({**machine, "numa_nodes": {"node0": "0-15"}})


def test_steal_and_core_sharing_are_read_and_summed_per_run(tmp_path):
    """steal from /proc/stat-shaped text, over the given CPUs only; two threads on one core by the
    sibling map; and the `host:` line per probed run."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 0 9 90 0 0 0 9\ncpu0 10 0 0 80 0 0 0 10\ncpu1 5 0 5 90 0 0 0 0\nintr 1\n")
    before = ab_probe.steal_ticks(stat)
    assert before == {0: (10, 100), 1: (0, 100)}
    stat.write_text("cpu0 20 0 0 140 0 0 0 40\ncpu1 10 0 10 180 0 0 0 0\n")
    assert ab_probe.steal_share(before, ab_probe.steal_ticks(stat), [0]) == 0.3    # 30 of 100 ticks
    assert ab_probe.steal_share(before, ab_probe.steal_ticks(stat), [0, 1]) == 0.15
    assert ab_probe.steal_share(before, before, [0]) is None
    core = {0: {0, 8}, 8: {0, 8}, 1: {1, 9}, 9: {1, 9}}.__getitem__
    samples = [{5: 0, 6: 8}, {5: 0, 6: 1}, {5: 9, 6: 9}, {5: 1}]
    assert ab_probe.same_core_share(samples, 5, 6, core) == {"samples": 3, "same_core": 2}
    assert ab_probe.parse_cpu_list(" 0-2, 8\n") == [0, 1, 2, 8]
    probe = {"steal_share": 0.012, "busiest_threads": {"threads": ["main", "pt_autograd_0/7"], "cpu_s": [6.9, 2.99],
                                                        "samples": 100, "same_core": 40}}
    runs = [{"pair": 1, "arm": "on", "value": 43_264.0, "probe": probe}, {"pair": 1, "arm": "off", "value": 1.0}]
    assert ab._host_notes(runs) == ["host: pair 2 on 43,264: steal 1.2% of its CPUs' time; main + pt_autograd_0/7 "
                                    "(6.9 + 3.0 s CPU) on one core in 40% of 100 samples"]


def test_runs_without_address_randomisation_start_under_setarch(tmp_path):
    import platform

    setup = ab.Setup(env={}, cpus=[0, 1], common=["--seed", "0"], metric="m", rank=0, cooldown_s=0.0,
                     run_timeout_s=1.0, keep_runs=False, workdir=tmp_path, no_aslr=True)
    argv = ab.train_argv(setup, tmp_path / "r", ["--max-steps", "3"], "off")
    assert argv[:6] == ["taskset", "-c", "0,1", "setarch", platform.machine(), "-R"]
    assert argv[-1] == "--no-profile" and "setarch" not in ab.train_argv(
        ab.Setup(**{**setup.__dict__, "no_aslr": False}), tmp_path / "r", [], "on")
