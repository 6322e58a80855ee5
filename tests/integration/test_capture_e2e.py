"""Kineto captures of a real two-rank CPU run: one scheduled by `--capture-at-step`, one asked of the live run by
`dflash-profile capture --run-dir`; both ranks' files begin at the same step, hold `ProfilerStep#N` and our
spans as user annotations, `dflash-report kernels` ranks CPU ops per span and Holistic Trace Analysis reads the
directory with one trace per rank. The refusals (not a dflash rank, a run that ended, --steps 0, a step already
passed) are one line and exit 2."""
from __future__ import annotations

import gzip
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash import profile_cli, report_cli
from profiler.schema.records import read_records
from profiler.clients.snapshot import live_ranks
from tests.hta_reader import provider, trace_analysis

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RUN_ARGS = ["--max-steps", "10000", "--builtin-conversations", "48", "--eval-prompts", "0",
            "--tokens-per-batch", "1024", "--max-length", "128", "--profile-interval", "1", "--device", "cpu",
            "--metrics-port", "0", "--capture-at-step", "3", "--capture-steps", "2"]
ROLES = {0: "drafter", 1: "target"}


def captures(run: Path, rank: int) -> list:
    path = run / "profile" / f"rank{rank}.jsonl"
    return [r for r in read_records(path)[0] if r.get("type") == "event" and r.get("kind") == "capture"] \
        if path.exists() else []


def _wait_for(what, fn, train, deadline_s: float = 150):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert train.poll() is None, f"dflash-train exited early ({train.returncode})"
        if fn():
            return
        time.sleep(0.3)
    raise AssertionError(f"not seen in {deadline_s} s: {what}")


@pytest.fixture(scope="module")
def captured_run(tmp_path_factory, prebuilt, live_run):
    """A live two-rank run with a scheduled capture at step 3, then one asked through `dflash-profile capture
    --run-dir` (2 steps), then stopped with SIGTERM (a clean stop at a step boundary)."""
    run = prebuilt(tmp_path_factory.mktemp("capture") / "run")
    with live_run(run, RUN_ARGS, {}) as train:
        _wait_for("the scheduled capture on both ranks",
                  lambda: all(captures(run, r) for r in (0, 1)), train)
        _wait_for("both ranks' endpoints", lambda: len(live_ranks(run)) == 2, train)
        asked = profile("capture", "--run-dir", str(run), "--steps", "2", "--round", "5", "--json")
        target_pid = next(r["pid"] for r in live_ranks(run) if r["rank"] == 1)
        live = {"past": profile("capture", "--run-dir", str(run), "--at-step", "1"),
                "memory": profile("memory", "--run-dir", str(run)),
                "pid": profile("capture", "--pid", str(target_pid), "--steps", "1", "--at-step", "100000",
                               "--no-wait", "--json")}   # far ahead: answered at the run's end, never taken
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=120)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    return run, json.loads(asked.stdout), train.returncode, live


def profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.profile_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_scheduled_capture_and_the_asked_one_begin_at_the_same_step_on_both_ranks(captured_run):
    run, asked, rc, _ = captured_run
    assert rc == 0
    n = asked["at_step"]
    assert n % 5 == 0 and n > 3 and [r["rank"] for r in asked["ranks"]] == [0, 1]
    for step, source in ((3, "schedule"), (n, "control")):
        for rank in (0, 1):
            ev = next(e for e in captures(run, rank) if e["step"] == step)
            path = run / "kineto" / f"rank{rank}-step{step}.json.gz"
            assert ev["files"] == [str(path)] and ev["source"] == source and ev["steps"] == [step, step + 1]
            assert ev["bytes"] == path.stat().st_size and not ev.get("error")
            trace = json.loads(gzip.open(path).read())
            assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
            names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
            assert {f"ProfilerStep#{step}", f"ProfilerStep#{step + 1}"} <= names
            ours = {s["name"] for s in ev["captured_spans"]}
            assert ours <= names and {"drafter.fwd_bwd" if rank == 0 else "target.pack_hidden"} <= ours
            assert {s["step"] for s in ev["captured_spans"]} == {step, step + 1}


def test_kinetos_own_lines_stay_out_of_the_runs_output(captured_run):
    """Issue 51: every capture printed Kineto's "USDT: ... profiler_start" lines into the run's stderr."""
    run = captured_run[0]
    text = (run.parent / "train.log").read_text(errors="replace")
    assert "dflash-train" in text or "step" in text, text[-2000:]   # the run's own output is there
    # Kineto's format: "USDT:2026-12-07 14:13:59 14777:14777 SyncActivityProfilerHandler.cpp:52] profiler_start"
    assert not re.findall(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\]", text, re.M), text[-3000:]


def test_report_kernels_ranks_cpu_ops_per_span(captured_run, capsys):
    run, asked, _, _ = captured_run
    assert report_cli.main(["kernels", str(run), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["capture"] == asked["at_step"] and rep["aligned"] and rep["captures"] == [3, asked["at_step"]]
    by_rank = {r["rank"]: r for r in rep["ranks"]}
    for rank, top in ((0, "drafter.fwd_bwd"), (1, "target.fwd")):
        r = by_rank[rank]
        assert r["role"] == ROLES[rank] and r["device"] == "cpu" and r["steps"] == [rep["capture"], rep["capture"] + 1]
        spans = {s["name"]: s for s in r["spans"]}
        ops = spans[top]["cpu_ops"]
        assert spans[top]["count"] == 2 and ops and ops == sorted(ops, key=lambda o: -o["seconds"])
        assert sum(o["seconds"] for o in ops) <= spans[top]["cpu_seconds"] * 1.01
    target_fwd = next(s for s in by_rank[1]["spans"] if s["name"] == "target.fwd")
    assert any(o["name"].startswith("aten::") for o in target_fwd["cpu_ops"])
    assert report_cli.main(["kernels", str(run), "--capture", "3"]) == 0
    text = capsys.readouterr().out
    assert "capture at step 3 (the captured steps 3-4 only" in text and "rank 0 (drafter, cpu)" in text


def test_holistic_trace_analysis_reads_one_trace_per_rank(captured_run, tmp_path):
    hta = trace_analysis()   # traceinsight or the older HolisticTraceAnalysis (tests/hta_reader.py); skips without
    run, asked, _, _ = captured_run
    one = tmp_path / "kineto"   # HTA reads every trace of a directory: one capture's
    one.mkdir()
    for rank in (0, 1):
        (one / f"rank{rank}.json.gz").write_bytes((run / "kineto" / f"rank{rank}-step{asked['at_step']}.json.gz")
                                                 .read_bytes())
    analysis = hta.TraceAnalysis(trace_dir=str(one))
    assert sorted(analysis.t.traces) == [0, 1], provider()
    for rank in (0, 1):
        assert len(analysis.t.traces[rank]) > 100, provider()


def test_refusals_are_one_line_and_exit_2(captured_run, tmp_path, capsys):
    run, asked, _, _ = captured_run
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cases = {("--pid", str(sleeper.pid)): f"pid {sleeper.pid} is not a dflash rank of yours",
                 ("--pid", "999999999"): "no such pid 999999999",
                 ("--run-dir", str(run)): "the run has ended",
                 ("--run-dir", str(tmp_path / "nothing")): "no such run directory",
                 ("--run-dir", str(run), "--steps", "0"): "--steps must be from 1 to 20, got 0"}
        for args, why in cases.items():
            assert profile_cli.main(["capture", *args]) == 2, args
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1 and why in err, (args, err)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert profile_cli.main(["memory", "--run-dir", str(run)]) == 2
    assert "the run has ended" in capsys.readouterr().err


def test_a_live_rank_past_the_step_and_a_cpu_rank_asked_for_memory_say_so_in_one_line(captured_run):
    _, _, _, live = captured_run
    past = live["past"]
    assert past.returncode == 2 and past.stdout == "" and past.stderr.count("\n") == 1
    assert "past step 1: a capture starts at a later step" in past.stderr and "rank 0 (drafter" in past.stderr
    mem = live["memory"]
    assert mem.returncode == 2, mem.stdout + mem.stderr
    assert mem.stdout.splitlines() == [f"rank {r} ({ROLES[r]}, pid {pid}): rank {r} ({ROLES[r]}) runs on the CPU: "
                                       "it has no CUDA allocator to snapshot"
                                       for r, pid in ((0, _pid(mem.stdout, 0)), (1, _pid(mem.stdout, 1)))] + [
        "memory forecast: none yet: no per-step allocator peaks: a CPU run, or a log written before them"]


def test_one_rank_is_armed_by_pid(captured_run):
    run, asked, _, live = captured_run
    armed = json.loads(live["pid"].stdout)
    (reply,) = armed["ranks"]
    assert live["pid"].returncode == 0 and reply["ok"] and reply["rank"] == 1 and reply["steps"] == 1
    assert armed["at_step"] == 100000 and reply["file"] == str(run.resolve() / "kineto" / "rank1-step100000.json.gz")
    ended = next(e for e in captures(run, 1) if e["step"] == 100000)
    assert ended["error"].startswith("the run ended at step ") and ended["files"] == []


def _pid(text: str, rank: int) -> int:
    line = text.splitlines()[rank]
    return int(line.split("pid ", 1)[1].split(")", 1)[0])
