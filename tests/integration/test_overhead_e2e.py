"""`dflash-profile overhead` against a real two-rank dflash-train run on CPU, whose profiled phases carry
a known cost: DFLASH_FAULT slows target.fwd and drafter.optim by 0.2 s, and faults fire only while the
profiler is on. The command must see the on phases that much slower, leave every rank profiling, refuse
a run another client paused, end with its whole pairs on SIGTERM, and resume the ranks on every exit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.control import query
from profiler.records import read_records
from profiler.snapshot import live_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024",
         "--max-length", "128", "--profile-interval", "1", "--device", "cpu", "--metrics-port", "0"]
SLOW = "slow=0.2@target.fwd;slow=0.2@drafter.optim"
# A profiled step takes ~0.45 s here (0.2 s of fault on each side, against ~0.2 s unprofiled): 2.5 s phases see
# ~5 of them, over the command's minimum of 3 even on a loaded machine, and every pair sees the cost.
PHASES = ["--pairs", "3", "--phase-s", "2.5", "--settle-s", "0.5"]


def profile(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.profile_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _wait_for_steps(run: Path, train: subprocess.Popen, steps: int = 3, deadline_s: float = 240) -> list[dict]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert train.poll() is None, f"dflash-train exited early ({train.returncode}); see {run.parent}/train.log"
        ranks = live_ranks(run)
        if len(ranks) == 2 and query(ranks[0]["socket_path"], "progress").get("step", 0) >= steps:
            return ranks
        time.sleep(0.5)
    raise AssertionError(f"rank 0 did not reach step {steps} in {deadline_s} s")


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory, prebuilt, live_run):
    """A real two-rank run, slowed only where it is profiled; yields (run dir, discovery records)."""
    run = prebuilt(tmp_path_factory.mktemp("overhead") / "run")
    with live_run(run, ["--max-steps", "2000", *SMALL], {"DFLASH_FAULT": SLOW}) as train:
        yield run, _wait_for_steps(run, train)


def _client(pid: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash.profile_cli", "overhead", "--pid", str(pid), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _paused_by(ranks: list[dict]) -> list:
    return [query(r["socket_path"], "progress")["paused_by"] for r in ranks]


def test_overhead_sees_the_profiled_phases_cost_ends_on_sigterm_and_leaves_the_run_profiling(slow_run, tmp_path):
    """Asked for 50 pairs and sent SIGTERM once it has printed its sixth phase: the whole pairs so far are
    the result (3, or 3 after a seventh phase the signal arrived in), as from a run that ended."""
    run, ranks = slow_run
    target_pid = next(r["pid"] for r in ranks if r["role"] == "target")
    client = _client(target_pid, "--pairs", "50", *PHASES[2:], "--out", str(tmp_path / "o.json"))
    for line in client.stderr:
        if line.startswith("dflash-profile overhead: phase 6 "):
            break
    client.send_signal(signal.SIGTERM)
    stdout, stderr = client.communicate(timeout=30)
    r = subprocess.CompletedProcess(client.args, client.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["ranks"] == 2 and result["pairs"] == 3 and result["resume_failed"] == []
    assert result["stopped"] == "stopped by SIGTERM" and "stopped early: stopped by SIGTERM" in r.stdout
    assert "SIGTERM: stopping after this phase" in r.stderr
    assert [p["arm"] for p in result["phases"]] == ["on", "off", "off", "on", "on", "off"]
    assert all(p["steps"] >= 3 for p in result["phases"])
    assert result["paired"]["mean_diff_pct"] < -20 and max(result["paired"]["ratios"]) < 1.0, result["paired"]
    assert "on vs off: -" in r.stdout and "on within 1% of off:" in r.stdout
    rows = {(t["rank"], t["name"]): t for t in result["threads_cpu"]["threads"]}   # /proc, named by the ranks
    assert rows[(0, "drafter.main")]["on_cpu_us"] > 0 and rows[(1, "target.main")]["off_cpu_us"] > 0, rows
    assert 0 < rows[(0, "drafter.main")]["on_busy_pct"] <= 101 and result["threads_cpu"]["wall_seconds"]["off"] > 0
    assert "CPU per rank-0 step (us; /proc schedstat)" in r.stdout
    assert _paused_by(ranks) == [None, None]
    recs = read_records(run / "profile" / "rank0.jsonl")[0]
    (noted,) = [x for x in recs if x["type"] == "event" and x["kind"] == "profile_overhead"]
    assert result["recorded"] is True and noted["mean_diff_pct"] == result["paired"]["mean_diff_pct"]
    report = subprocess.run([sys.executable, "-m", "dflash.report_cli", "hotspots", str(run)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert f"profiling cost, measured in the run (dflash-profile overhead, step {noted['step']}): on vs off " \
           f"{noted['mean_diff_pct']:+.2f}%" in report.stdout, report.stdout[-2000:] + report.stderr[-2000:]
    paused = [x for x in recs if x["type"] == "interval" and x.get("pauses")]
    assert paused and all(0 < x["paused_seconds"] <= x["duration_seconds"] for x in paused)
    closed = len([x for x in recs if x["type"] == "interval"])
    time.sleep(2.5)   # profiled again: new intervals with the drafter's spans
    later = [x for x in read_records(run / "profile" / "rank0.jsonl")[0] if x["type"] == "interval"][closed:]
    assert any(x["spans"].get("drafter.fwd_bwd", {}).get("count") for x in later)


def test_a_run_paused_by_another_client_is_refused_before_any_phase(slow_run):
    _, ranks = slow_run
    assert query(ranks[1]["socket_path"], "pause", owner="someone else", lease_s=30)["ok"]
    try:
        r = profile("overhead", "--pid", str(ranks[0]["pid"]), *PHASES)
    finally:
        assert query(ranks[1]["socket_path"], "resume", owner="someone else")["ok"]
    assert r.returncode == 2 and r.stderr.strip().endswith("rank 1 is paused by someone else"), r.stderr
    assert r.stderr.count("\n") == 1 and _paused_by(ranks) == [None, None]


def test_a_client_signalled_twice_stops_at_once_and_resumes_every_rank(slow_run):
    _, ranks = slow_run
    client = _client(ranks[0]["pid"], "--pairs", "50", "--phase-s", "2.5", "--settle-s", "0.2")
    deadline = time.monotonic() + 30
    while None in _paused_by(ranks) or len(set(_paused_by(ranks))) != 1:   # in its first off phase
        assert time.monotonic() < deadline and client.poll() is None, client.communicate()
        time.sleep(0.05)
    client.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    client.send_signal(signal.SIGTERM)
    _, err = client.communicate(timeout=30)
    assert client.returncode == 128 + signal.SIGTERM, err
    assert _paused_by(ranks) == [None, None]


def test_a_background_part_keeps_the_inline_cost_in_both_arms(slow_run, tmp_path):
    """--part background pauses the collector, interval clock and samplers only: the fault, which fires
    through spans (inline), slows both arms alike, so the 0.2 s per step the default part sees is gone."""
    run, ranks = slow_run
    r = profile("overhead", "--pid", str(ranks[0]["pid"]), "--part", "background", "--pairs", "2", "--phase-s",
                "2.5", "--settle-s", "0.5", "--out", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["part"] == "background" and result["pairs"] == 2 and result["resume_failed"] == []
    assert result["paired"]["mean_diff_pct"] > -15, result["paired"]   # the whole part: about -55%
    assert "off phases pause the background part only" in r.stdout and _paused_by(ranks) == [None, None]
    recs = read_records(run / "profile" / "rank0.jsonl")[0]
    noted = [x for x in recs if x["type"] == "event" and x["kind"] == "profile_overhead"][-1]
    assert noted["part"] == "background"
    assert any(x.get("paused_parts") == ["background"] for x in recs if x["type"] == "interval")
    report = subprocess.run([sys.executable, "-m", "dflash.report_cli", "hotspots", str(run)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert f"cost of the profiler's background part, measured in the run (dflash-profile overhead, step " \
           f"{noted['step']})" in report.stdout, report.stdout[-2000:]
