"""Issue 37 item 4, the trainer's part: output that guides. The shared healthy run's console (the README default
run) shows a progress line with EMAs, lr, a labelled recent rate and an ETA, interval tables whose columns hold
what their headers say, and an end with the wall time, the verdict, the top findings and the report command,
agreeing with `dflash-report hotspots`; and `dflash-train | head` ends the reading, not the run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from profiler import report
from dflash.advice import ADVICE
from profiler.schema.records import read_records

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_the_progress_line_shows_emas_lr_a_recent_rate_and_an_eta(healthy_run):
    lines = [line for line in healthy_run.stdout.replace("\r", "\n").splitlines() if line.startswith("[")
             and " step " in line and not line.startswith("[profile]")]
    assert lines, healthy_run.stdout[-2000:]
    pattern = (r"\[[#-]{20}\] step (\d+)/150 \| loss (\d+\.\d{3}|\s-\s) tau (\d+\.\d{2}|\s-\s) \(EMA, span 20 steps\) \| "
               r"lr (\d\.\d\de-\d\d|-) \| [\d,]+ tok/s \(last (\d+) s\) \| \w+, (ETA \w+|done)")
    parsed = [re.fullmatch(pattern, line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed) if not m][:3]
    assert all(int(m.group(5)) <= 30 for m in parsed)     # the recent window: at most 30 s, labelled
    assert parsed[-1].group(1) == "150" and parsed[-1].group(6) == "done"
    assert any(m.group(6).startswith("ETA ") for m in parsed)


def test_interval_columns_hold_what_their_headers_say(healthy_run):
    """No span row runs past its share column (the open-span note is its own line)."""
    rows = [line for line in healthy_run.stdout.splitlines() if re.match(r"  [a-z_]+\.[a-z_.]+ +\d+ (cpu|gpu) ", line)]
    assert rows
    bad = [row for row in rows if not (row.split()[5].endswith("%") and (len(row.split()) == 6 or "GB/s" in row))]
    assert not bad, bad[:3]


def test_the_end_of_the_run_says_its_wall_time_verdict_findings_and_the_report_command(healthy_run):
    out, run = healthy_run.stdout, healthy_run.run
    wall = re.search(r"^wall time: (?:(\d+) min (\d+) s|([\d.]+) s) from launch to the end$", out, re.M)
    assert wall, out[-3000:]
    seconds = int(wall.group(1)) * 60 + int(wall.group(2)) if wall.group(1) else float(wall.group(3))
    assert 0.5 * healthy_run.wall_seconds <= seconds <= healthy_run.wall_seconds + 1
    rep = report.hotspots(run, advice=ADVICE)   # what the end of the run and dflash-report pass
    verdict = re.search(r"^verdict \((.+)\): (\S+)$", out, re.M)
    assert verdict and verdict.group(2) == (rep["verdict"]["verdict"] or "none")   # dflash-report's, same run
    found = rep["findings"]
    if found:
        assert f"top findings ({min(3, len(found))} of {len(found)}):" in out
        assert f"  1. {found[0]['summary']}" in out and f"     next: {found[0]['next']}" in out
    # the report's command as this run was started (python -m): runnable as printed (README's form: test_readme_loop)
    assert f"full report: {shlex.join([sys.executable, '-m', 'dflash.report_cli'])} hotspots {run}" in out
    assert out.rstrip().endswith(f"run directory: {run}")


def test_a_closed_stdout_ends_the_reading_not_the_run(tmp_path, prebuilt):
    """`dflash-train ... | head -3`: after the reader is gone the run trains on to its end (checkpoint, evaluation,
    run_end ok on every rank), exits 0, and no BrokenPipeError or traceback reaches stderr."""
    run = prebuilt(tmp_path / "run")
    args = ["--run-dir", str(run), "--max-steps", "6", "--builtin-conversations", "48", "--eval-prompts", "2",
            "--eval-new-tokens", "8", "--tokens-per-batch", "1024", "--max-length", "128", "--profile-interval",
            "1", "--device", "cpu", "--metrics-port", "0"]
    train = subprocess.Popen([sys.executable, "-m", "dflash.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    head = subprocess.run(["head", "-3"], stdin=train.stdout, capture_output=True, timeout=240)
    train.stdout.close()   # the reader is gone: the next write to the pipe fails with EPIPE
    _, err = train.communicate(timeout=240)
    assert len(head.stdout.decode().splitlines()) == 3
    assert train.returncode == 0, err.decode()[-3000:]
    assert b"BrokenPipe" not in err and b"Traceback" not in err, err.decode()[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    recs = {r: read_records(run / "profile" / f"rank{r}.jsonl")[0] for r in (0, 1)}
    assert all([x for x in recs[r] if x["type"] == "run_end"][-1]["status"] == "ok" for r in recs)
    assert any(x["type"] == "event" and x.get("kind") == "eval" for x in recs[0])


@pytest.mark.parametrize("argv", [["dflash.cli", "--help"], ["dflash.report_cli", "hotspots", "{run}"],
                                  ["dflash.report_cli", "check", "{run}"], ["dflash.report_cli", "--help"],
                                  ["dflash.profile_cli", "--help"]])
def test_every_cli_is_quiet_when_its_reader_is_gone(healthy_run, argv):
    """Its stdout a pipe whose reader has gone before the command writes (`... | head` after head's last line):
    exit 0 and nothing on stderr. (dflash-profile's other commands need a live run: their output goes through
    the same dflash.cli_output as dflash-report's.)"""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        r = subprocess.run([sys.executable, "-m", *(a.format(run=healthy_run.run) for a in argv)], cwd=REPO,
                           stdout=write_fd, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_fd)
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()


def test_two_ranks_lines_on_one_stderr_never_interleave():
    """Ranks share the launcher's stderr under PYTHONUNBUFFERED (dflash.launch), where print() writes its text and
    its newline separately: two ranks' error lines came out as one ("... stop)dflash-train: error: rank 0: ...",
    seen in CI). Two real processes through the rank entry's `whole_lines` print 1,500 lines each into one pipe:
    every line arrives whole (without it, about a quarter of such lines were broken on the 2-core VM)."""
    child = ("import sys\nfrom dflash.cli_output import whole_lines\nwhole_lines(sys.stderr)\n"
             "for i in range(1500):\n    print(f'rank {sys.argv[1]} line {i} ' + 'x' * 60, file=sys.stderr)\n")
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", child, str(r)], stderr=write_fd, env=env) for r in (0, 1)]
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    broken = [line for line in lines if not re.fullmatch(r"rank [01] line \d+ x{60}", line)]
    assert len(lines) == 3000 and not broken, broken[:3]
