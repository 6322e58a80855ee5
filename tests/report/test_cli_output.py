"""What the CLIs print (issue 34 row 6, issue 37): strings from a log reach the terminal with their control
characters escaped, and a closed pipe ends the command quietly."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import report_cli
from profiler.schema.records import printable
from tests.report.test_check import clean, write

REPO = Path(__file__).resolve().parents[2]
NASTY = "\x1b]0;owned\x07\x1b[2J\x1b]52;c;cGF5bG9hZA==\x07\r\x9b1K"


def test_printable_escapes_every_control_character_but_newline_and_tab():
    assert printable("a\tb\nc") == "a\tb\nc"
    out = printable(NASTY)
    assert not any(ord(ch) < 0x20 and ch not in "\t\n" or 0x7F <= ord(ch) < 0xA0 for ch in out)
    assert "\\x1b]0;owned\\x07" in out and "\\x9b" in out


def test_hotspots_of_a_log_with_escapes_prints_none_of_them(tmp_path, capsys):
    run = clean()
    for recs in run["logs"].values():
        for r in recs:
            if r.get("type") == "interval":
                r["threads_cpu_seconds"] = {f"evil{NASTY}": 0.5}
                for e in (r.get("spans") or {}).values():
                    e["threads"] = [f"main{NASTY}"]
            if r.get("type") == "run_start":
                r["hostname"] = f"host{NASTY}"
    run_dir = write(tmp_path / "run", run)
    assert report_cli.main(["hotspots", str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err and "\x07" not in out.out and "\\x1b" in out.out


def test_a_closed_pipe_ends_quietly(tmp_path):
    run_dir = write(tmp_path / "run", clean())
    p = subprocess.run(f"{sys.executable} -m dflash.report_cli hotspots --json {run_dir} | true", shell=True,
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == ""   # the reader is gone before the first write


@pytest.mark.parametrize("command", sorted(report_cli.COMMANDS))
def test_every_report_command_piped_into_head_ends_quietly(tmp_path, command):
    """`dflash-report CMD RUN_DIR | head -1` (issue 37), for every subcommand the CLI has: exit as unpiped (0 on this
    clean run for hotspots, check and trace; a command needing other inputs may refuse it, exit 2, on stderr), no
    BrokenPipeError traceback. `| true` is gone before the command prints, so the closed pipe is certain."""
    run_dir = write(tmp_path / "run", clean())
    for reader, lines in (("head -1", 1), ("true", 0)):
        p = subprocess.run(f"{sys.executable} -m dflash.report_cli {command} {run_dir} | {reader}; "
                           "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", cwd=REPO,
                           capture_output=True, text=True)
        assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, (reader, p.stderr)
        if command in ("hotspots", "check", "trace"):
            assert (p.returncode, p.stderr, len(p.stdout.splitlines())) == (0, "", lines), (reader, p)
        else:
            assert p.returncode in (0, 2), (reader, p)


def test_a_failing_check_piped_into_a_gone_reader_still_fails(tmp_path):
    """The reader leaving early ends the command quietly, but with the status the command found: exit 1 for a
    broken invariant, so `set -o pipefail; dflash-report check RUN | head` still fails."""
    run = clean()
    next(r for r in run["logs"][0] if r.get("type") == "interval")["spans"]["drafter.fwd_bwd"]["share"] = 5.0
    run_dir = write(tmp_path / "run", run)
    p = subprocess.run(f"{sys.executable} -m dflash.report_cli check {run_dir} | true; exit ${{PIPESTATUS[0]}}",
                       shell=True, executable="/bin/bash", cwd=REPO, capture_output=True, text=True)
    assert (p.returncode, p.stderr) == (1, ""), p


def test_the_console_summary_escapes_a_thread_name(tmp_path):
    """A training process's own threads can be named by anyone's code: rank 0's interval summary escapes them."""
    import io

    from exporters.console import ConsoleExporter

    out = io.StringIO()
    ConsoleExporter(stream=out).export({"type": "interval", "rank": 0, "role": "drafter", "index": 0, "step": 1,
                                        "duration_seconds": 1.0, "spans": {},
                                        "threads_cpu_seconds": {f"loader{NASTY}": 0.5}})
    assert "\x1b" not in out.getvalue() and "loader\\x1b]0;owned" in out.getvalue()


@pytest.mark.parametrize("damage, why", [
    (lambda r: r.update(spans=[1, 2]), "spans is list"),
    (lambda r: r.update(step="7"), "step is str"),
    (lambda r: next(iter(r["spans"].values())).update(count="3"), "is not an entry with an integer count"),
    (lambda r: next(iter(r["spans"].values()))["cpu"].update(total_seconds="x"), "holds a non-number"),
    (lambda r: r.update(counters={"tokens": {"total": "many"}}), "counter 'tokens' has no numeric total"),
])
def test_a_record_of_the_wrong_shape_is_counted_and_skipped_with_its_line(tmp_path, capsys, damage, why):
    """Issue 34 row 10: wrong-typed fields in a run log gave tracebacks (3 of 5 cases); now the record is
    skipped, counted as a bad line and named file:line, and the rest of the log is reported."""
    run = clean()
    recs = run["logs"][0]
    i = next(i for i, r in enumerate(recs) if r.get("type") == "interval" and r.get("index") == 1)
    damage(recs[i])
    run_dir = write(tmp_path / "run", run)
    assert report_cli.main(["hotspots", "--json", str(run_dir)]) == 0
    rep = json.loads(capsys.readouterr().out)
    bad = rep["events"]["kinds"]["bad_lines"]
    assert bad["count"] == 1
    (where,) = bad["examples"][0]["where"]
    assert where.startswith(f"{run_dir / 'profile' / 'rank0.jsonl'}:{i + 1}: ") and why in where
