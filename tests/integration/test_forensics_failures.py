"""Forensics rows of issue #12 on CPU, through the real 2-process run (rank 0 drafter, rank 1 target):
a hang (the watchdog), an OOM, a crash on the target rank; plus the launcher's supervision over
real processes (grace then SIGKILL; a second signal escalates). The CUDA OOM test skips without a GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.launch import Supervisor
from profiler.runlog import read_records

REPO = Path(__file__).resolve().parents[2]
# tests/integration/test_pipeline.py's SMALL run without evaluation: ~15 s on 2 cores.
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length",
         "128", "--profile-interval", "2", "--device", "cpu", "--max-steps", "8"]


def train(run: Path, fault: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """The run and the Unix time its launcher had exited."""
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *SMALL, *extra], cwd=REPO,
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, DFLASH_FAULT=fault))
    return r, time.time()


def logs(run: Path) -> dict[int, list[dict]]:
    out = {}
    for rank in (0, 1):
        recs, truncated = read_records(run / "profile" / f"rank{rank}.jsonl")
        assert truncated == 0
        out[rank] = recs
    return out


def events(recs: list[dict], kind: str) -> list[dict]:
    return [r for r in recs if r["type"] == "event" and r["kind"] == kind]


def assert_every_log_ends_with_run_end(by_rank: dict) -> dict[int, str]:
    for rank, recs in by_rank.items():
        assert recs[-1]["type"] == "run_end", (rank, [r["type"] for r in recs[-3:]])
    return {rank: recs[-1]["status"] for rank, recs in by_rank.items()}


def forensics_files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "forensics").iterdir())


@pytest.mark.slow
def test_a_hang_is_dumped_on_every_rank_and_stops_the_job_within_the_timeout_plus_5s(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r, ended = train(run, "hang@target.fwd:step=3:rank=1", "--hang-timeout-s", "4")
    assert r.returncode == 1, r.stderr[-3000:]
    by_rank = logs(run)
    statuses = assert_every_log_ends_with_run_end(by_rank)
    (hang,) = events(by_rank[1], "hang")
    (stuck,) = [e for e in hang["open_spans"] if e["thread"] == "target.main"]
    assert stuck["spans"][-1]["name"] == "target.fwd" and hang["stalled_seconds"] >= 4
    assert any("faults.py" in f and "on_enter" in f
               for t in hang["threads"] if t["thread"] == "target.main" for f in t["stack"])
    hang_began = hang["time_unix"] - stuck["spans"][-1]["open_seconds"]
    assert ended - hang_began <= 4 + 5
    # intervals written during the hang say what is still open and for how long
    during = [x for x in by_rank[1] if x["type"] == "interval" and x["time_unix"] > hang_began + 1]
    assert any(e["spans"][-1]["name"] == "target.fwd" and e["spans"][-1]["open_seconds"] >= 1
               for x in during for e in x["open_spans"])
    # the drafter, blocked in drafter.recv, is dumped too: by its own watchdog or on the SIGTERM
    assert statuses[1] == "hang" and statuses[0] in ("hang", "killed: SIGTERM")
    assert events(by_rank[0], "hang") or events(by_rank[0], "signal")
    names = forensics_files(run)
    assert any(n.startswith("rank1-hang-") for n in names) and any(n.startswith("rank0-") for n in names)
    assert "rank 1: no progress for" in r.stderr
    assert list((run / "control").glob("*.sock")) == []   # os._exit left no endpoint behind


@pytest.mark.slow
def test_an_oom_is_recorded_with_memory_state_and_every_rank_ends_its_log(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r, ended = train(run, "oom@drafter.fwd_bwd:step=3:rank=0")
    assert r.returncode == 1, r.stderr[-3000:]
    by_rank = logs(run)
    statuses = assert_every_log_ends_with_run_end(by_rank)
    assert statuses[0] == "OutOfMemoryError"
    (oom,) = events(by_rank[0], "oom")
    assert oom["step"] == 3 and "injected oom at drafter.fwd_bwd step 3" in oom["error"]
    assert oom["thread"] == "drafter.main" and "faults.py" in oom["traceback"]
    assert oom["allocator"] == {"available": False, "reason": "allocator stats need a CUDA device"}
    assert isinstance(oom["headroom_history"], list) and "open_spans" in oom
    assert any(t["thread"] == "drafter.receiver" for t in oom["threads"])   # every thread, not just the failing one
    assert any(n.startswith("rank0-oom-") for n in forensics_files(run))
    assert ended - oom["time_unix"] <= 5


@pytest.mark.slow
def test_a_crash_on_a_target_rank_stops_the_job_within_5s_and_every_rank_writes_run_end(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r, ended = train(run, "crash@target.fwd:step=3:rank=1")
    assert r.returncode == 1, r.stderr[-3000:]
    by_rank = logs(run)
    statuses = assert_every_log_ends_with_run_end(by_rank)
    assert statuses[1] == "InjectedFault"
    (crash,) = events(by_rank[1], "thread_crash")
    assert crash["thread"] == "target.main" and "injected crash at target.fwd step 3 rank 1" in crash["traceback"]
    assert ended - crash["time_unix"] <= 5
    # the drafter, blocked in drafter.recv, ends its own log instead of being SIGKILLed without one
    assert statuses[0] in ("killed: SIGTERM", "RuntimeError")
    assert any(n.startswith("rank1-thread_crash-") for n in forensics_files(run))
    # the first failure is the one the console names first (a busy metrics port's fallback line may come before)
    said = [line for line in r.stderr.splitlines()
            if line.startswith("dflash-train: rank ") and "metrics port" not in line]
    assert said and said[0].startswith("dflash-train: rank 1 failed"), r.stderr[-3000:]


def test_a_crashed_worker_thread_stops_its_process_with_exit_1_while_the_main_thread_is_stuck(tmp_path):
    """threading.excepthook in a real process: the real os._exit path, the main thread never returning."""
    code = ("import threading, time, profiler\n"
            "from profiler.config import ProfilerConfig\n"
            f"with profiler.Profiler({str(tmp_path)!r}, config=ProfilerConfig(control=False, measure_floors=False)):\n"
            "    def work():\n"
            "        raise KeyError('lost batch')\n"
            "    with profiler.span('train.wait'):\n"
            "        threading.Thread(target=work, name='loader').start()\n"
            "        time.sleep(60)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    assert "thread loader crashed" in r.stderr and "KeyError: 'lost batch'" in r.stderr
    recs, _ = read_records(tmp_path / "profile" / "rank0.jsonl")
    (crash,) = events(recs, "thread_crash")
    assert crash["thread"] == "loader" and crash["open_spans"][0]["spans"][0]["name"] == "train.wait"
    assert recs[-1]["type"] == "run_end" and recs[-1]["status"] == "thread_crash: KeyError"
    assert (tmp_path / "forensics").is_dir()


# -------------------------------------------------------------------- supervision, real processes
def sleeper(ignore_sigterm: bool) -> subprocess.Popen:
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, signal.SIG_IGN if {ignore_sigterm} else signal.SIG_DFL)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    return p


def failing() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])


def test_the_first_failure_stops_the_rest_sigkilling_a_rank_that_ignores_sigterm_after_the_grace():
    procs = [sleeper(ignore_sigterm=True), sleeper(ignore_sigterm=False), failing()]
    t0 = time.monotonic()
    assert Supervisor(procs, grace_s=1.0, poll_s=0.05).run() == 1
    assert time.monotonic() - t0 < 4
    assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGTERM, 1]


def test_a_second_signal_to_the_launcher_escalates():
    procs = [sleeper(ignore_sigterm=True)]
    sup = Supervisor(procs, grace_s=0.5, poll_s=0.05, repeat_after_s=0.2)
    sup.forward(signal.SIGTERM)                  # ignored by the rank: the run would go on
    assert procs[0].poll() is None
    time.sleep(0.25)
    sup.forward(signal.SIGTERM)                  # the second, repeat_after_s later: SIGKILL after the grace
    t0 = time.monotonic()
    assert sup.run() == 1 and time.monotonic() - t0 < 3
    assert procs[0].returncode == -signal.SIGKILL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_oom_saves_the_allocator_history_snapshot(tmp_path):
    import profiler
    from profiler.config import ProfilerConfig

    with pytest.raises(torch.OutOfMemoryError):
        cfg = ProfilerConfig(control=False, measure_floors=False, memory_history=10000)
        with profiler.Profiler(tmp_path, device=torch.device("cuda", 0), config=cfg) as prof, prof.dumper.guard():
            with profiler.span("train.alloc"):
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    recs, _ = read_records(tmp_path / "profile" / "rank0.jsonl")
    (oom,) = events(recs, "oom")
    assert oom["allocator"]["available"] and oom["memory_history_file"]
    assert 0 < os.path.getsize(oom["memory_history_file"]) < 512 << 20   # bounded by max_entries
