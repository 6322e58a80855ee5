"""`dflash-profile top` in a real 80x24 terminal (tmux) against a real two-rank dflash-train run on CPU: the ranks'
rows with their rates, the sort key, the drafter stuck in drafter.fwd_bwd (DFLASH_FAULT=slow=...: it sleeps
inside the span, then trains on), the target frozen by SIGSTOP shown as not answering (the view goes on), both
ranks ended with their run_end status once the run ends normally, `q`; and `--once` from a script."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.clients.snapshot import live_ranks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
SLOW_STEP, SLOW_S = 3, 8
# tests/integration/test_pipeline.py's SMALL run without evaluation; an interval (and so a tick) every second
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128",
         "--profile-interval", "1", "--device", "cpu", "--max-steps", str(STEPS)]
FAULT = f"slow={SLOW_S}@drafter.fwd_bwd:step={SLOW_STEP}:rank=0"


class Tmux:
    """One tmux server of the test's own (its socket at `socket_path`), one 80x24 session running a command."""

    def __init__(self, socket_path: Path, command: str):
        self.base = ["tmux", "-S", str(socket_path)]
        subprocess.run([*self.base, "new-session", "-d", "-s", "top", "-x", "80", "-y", "24", command], check=True,
                       env=dict(os.environ, TERM="xterm-256color"), timeout=10)

    def pane(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True,
                              timeout=10).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "top", *keys], check=True, timeout=10)

    def pane_pid(self) -> int:
        return int(subprocess.run([*self.base, "list-panes", "-t", "top", "-F", "#{pane_pid}"], capture_output=True,
                                  text=True, timeout=10).stdout.split()[0])

    def wait_for(self, what, timeout_s: float, why: str, train=None) -> str:
        """The pane once what(pane) holds; fails with the last pane and the run's state after timeout_s."""
        deadline, pane = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            pane = self.pane()
            if what(pane):
                return pane
            time.sleep(0.3)
        ended = "" if train is None else f" (dflash-train returncode {train.poll()})"
        raise AssertionError(f"the pane never showed {why} in {timeout_s:g} s{ended}:\n{pane}")

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=10)


def row(pane: str, rank: int) -> tuple:
    """(rank's figures line, its second line) in the pane."""
    lines = pane.splitlines()
    i = next((i for i, line in enumerate(lines) if line[:5] == f"{rank:>4} "), None)
    return ("", "") if i is None or i + 1 >= len(lines) else (lines[i], lines[i + 1])


def running_with_rates(pane: str) -> bool:
    return all(re.match(rf"^\s+{r} \S+\s+\d+ running\s+[\d,.]+\s+[\d.]+\s+\d+s", row(pane, r)[0]) for r in (0, 1))


def stalled(pane: str) -> bool:
    """The drafter's row: drafter.fwd_bwd open 5 s or more (stuck, or not yet past its limit), no tokens in WIN."""
    figures, detail = row(pane, 0)
    age = re.search(r"(?:STUCK in|open:) drafter\.fwd_bwd (\d+\.\d) s", detail)
    no_tokens = re.match(r"^\s+0 drafter\s+\d+ (running|STUCK \d+s)\s+0\s+0\.00\s", figures)
    return age is not None and float(age.group(1)) >= 5.0 and no_tokens is not None


def top_once(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.profile_cli", "top", "--run-dir", str(run), "--once"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="80"))


def _wait_live(run: Path, train, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert train.poll() is None, f"dflash-train exited early ({train.returncode}); see {run.parent}/train.log"
        ranks = live_ranks(run)
        if len(ranks) == 2:
            return {r["role"]: r["pid"] for r in ranks}
        time.sleep(0.3)
    raise AssertionError(f"the run's two ranks never served their endpoints in {timeout_s:g} s")


def _check_once(run: Path) -> None:
    """`--once` into a pipe: one plain frame of both ranks, 80 columns, no escape codes."""
    r = top_once(run)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines) and "\x1b" not in r.stdout, r.stdout
    assert ": 2 ranks, 2 live" in lines[0] and row(r.stdout, 0)[0].split()[1] == "drafter", r.stdout
    assert row(r.stdout, 1)[0].split()[1] == "target" and not lines[-1].startswith("sort:"), r.stdout


def _check_not_answering(tmux: Tmux, target_pid: int, train) -> None:
    """The target frozen: its row says so with the age of its last answer, which grows (the view refreshes on), while
    the drafter still answers."""
    os.kill(target_pid, signal.SIGSTOP)
    try:
        pane = tmux.wait_for(lambda p: re.search(r"NO ANSWER [2-9]s", row(p, 1)[0]), 20, "rank 1 not answering",
                             train)
        assert "no answer for " in row(pane, 1)[1] and "TimeoutError" in row(pane, 1)[1], pane
        assert row(pane, 0)[0].split()[3] in ("running", "STUCK"), pane
    finally:
        os.kill(target_pid, signal.SIGCONT)


def test_top_follows_a_live_run_through_a_stall_a_frozen_rank_and_its_end(tmp_path, prebuilt, live_run):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (scripts/test.sh installs Debian's tmux with apt)")
    run = prebuilt(tmp_path / "run")
    command = (f"{sys.executable} -m dflash.profile_cli top --run-dir {run} --interval 1 --window 3; "
               "echo TOP-EXIT=$?; sleep 60")
    with live_run(run, SMALL, {"DFLASH_FAULT": FAULT}) as train:
        pids = _wait_live(run, train)
        tmux = Tmux(tmp_path / "tmux.sock", f"cd {REPO} && {command}")
        try:
            started = time.monotonic()
            pane = tmux.wait_for(running_with_rates, 60, "both ranks running with rates", train)
            assert all(len(line) <= 80 for line in pane.splitlines())
            assert "bound stage: " in pane and "sort: rank " in pane, pane
            _check_once(run)
            tmux.keys("s")
            tmux.wait_for(lambda p: "sort: step " in p, 5, "the step sort")
            pane = tmux.wait_for(stalled, 60, "the drafter 5 s into drafter.fwd_bwd", train)
            figures, detail = row(pane, 0)
            if figures.split()[3] == "STUCK":   # over max(10 x its recent p95, 5 s): a loaded machine's p95 is larger
                assert detail.strip().startswith("STUCK in drafter.fwd_bwd ") and detail.endswith(" on drafter.main")
            _check_not_answering(tmux, pids["target"], train)
            pane = tmux.wait_for(lambda p: ": 2 ranks, 0 live, 2 ended" in p, 90, "both ranks ended", train)
            assert train.wait(timeout=60) == 0
            for rank in (0, 1):
                figures, detail = row(pane, rank)
                assert figures.split()[2:4] == [str(STEPS - 1), "ended"], pane   # steps count from 0
                assert detail.strip() == f"ended: ok at step {STEPS - 1} (its run_end)", pane
            top_cpu_s = _cpu_seconds(tmux.pane_pid())
            tmux.keys("q")
            tmux.wait_for(lambda p: "TOP-EXIT=0" in p, 10, "top's exit 0 on q")
        finally:
            tmux.close()
    # no busy loop: it sleeps between refreshes (a spinning view would take a core all along)
    assert top_cpu_s < 0.3 * (time.monotonic() - started), top_cpu_s
    r = top_once(run)
    assert r.returncode == 2 and r.stderr.startswith(f"dflash-profile: error: no live rank of {run}"), r.stderr


def _cpu_seconds(shell_pid: int) -> float:
    """The CPU seconds of the pane's processes so far (the shell and the top under it)."""
    import psutil

    shell = psutil.Process(shell_pid)
    procs = [shell, *shell.children(recursive=True)]
    assert any("top" in p.cmdline() and "dflash.profile_cli" in p.cmdline() for p in procs), procs
    return sum(sum(p.cpu_times()[:2]) for p in procs)
