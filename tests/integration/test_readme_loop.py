"""The README's "Using the profiler in any training loop" example, run exactly as printed (issue 37, item 2): its
python block is copied into a file and run in a fresh interpreter from an empty directory, with nothing else given.
While it trains, its Prometheus endpoint (the URL it prints) is scraped; afterwards its run directory must hold
what the README says (intervals with steps/s, detail spans, a Perfetto trace), and `dflash-report check` and
`dflash-report hotspots` must read it (exit 0), the latter without DFlash-only sections or dflash-train flags."""
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dflash import report_cli
from profiler.schema.records import read_records
from tests.report.test_loop_report import assert_no_pipeline_noise

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Using the profiler in any training loop"
URL = re.compile(r"serves Prometheus metrics at (http://\S+/metrics)")


def readme_loop_example() -> str:
    """The first python block of the README's section, verbatim."""
    text = (REPO / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(SECTION):], re.S).group(1)


def _scrape_while_running(proc: subprocess.Popen, err_lines: list) -> str:
    """The last /metrics text that held the tokens counter, scraped every 0.3 s from the URL the example printed
    until it exits ("" if none did)."""
    got = ""
    while proc.poll() is None:
        url = next((m.group(1) for line in list(err_lines) if (m := URL.search(line))), None)
        if url is not None:
            try:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
            except OSError:
                text = ""
            if "dflash_tokens_total{" in text:
                got = text
        time.sleep(0.3)
    return got


def _run_example(tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "example.py").write_text(readme_loop_example())
    proc = subprocess.Popen([sys.executable, "example.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    out_lines: list = []
    err_lines: list = []
    readers = [threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True),
               threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        scrape = _scrape_while_running(proc, err_lines)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    for reader in readers:
        reader.join(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out_lines), "".join(err_lines)), scrape


def test_the_readme_loop_example_runs_as_printed_and_its_run_reads_back(tmp_path, capsys):
    done, scrape = _run_example(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (run,) = sorted((tmp_path / "runs").glob("loop-*"))
    recs, bad = read_records(run / "profile" / "rank0.jsonl")
    assert bad == 0
    intervals = [r for r in recs if r["type"] == "interval"]
    rates = [r["step_rate"]["per_second"] for r in intervals if not r.get("final")]
    assert len(rates) >= 2 and all(rate and rate > 0 for rate in rates), rates   # set_step: steps/s each interval
    assert all((r["counters"]["tokens"]["total"] or 0) > 0 for r in intervals if not r.get("final"))
    # the last interval can close after the last step logged its loss: it then holds no loss of its own
    losses = [r["metrics"]["loss"]["last"] for r in intervals if "loss" in (r.get("metrics") or {})]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses                    # it trains
    detail = [s["name"] for r in recs if r["type"] == "spans" for s in r["spans"]]
    assert {"trainer.data", "trainer.fwd_bwd", "trainer.optim"} <= set(detail)     # the detail window's raw spans
    trace = json.loads((run / "trace" / "rank0.json").read_text())
    assert {"trainer.fwd_bwd", "trainer.optim"} <= {e.get("name") for e in trace["traceEvents"]}
    # scraped while it ran: every required label set (the host from the machine), the loop's counter and loss
    assert re.search(r'dflash_tokens_total\{[^}]*host="[^"]+"[^}]*role="trainer"', scrape), scrape[:2000]
    assert "dflash_train_loss{" in scrape and 'span="trainer.fwd_bwd"' in scrape
    # the console: each interval's summary with its step rate, and at the end the table and the report command
    assert "[profile] rank 0 trainer" in done.stdout and "steps/s)" in done.stdout
    assert "whole run:" in done.stdout and f"dflash-report hotspots runs/{run.name}" in done.stdout

    capsys.readouterr()
    assert report_cli.main(["check", str(run)]) == 0, capsys.readouterr().out
    assert report_cli.main(["hotspots", str(run)]) == 0
    text = capsys.readouterr().out
    assert "trainer.fwd_bwd" in text and "Ranks (" in text and "steps/s (per rank)" in text
    assert_no_pipeline_noise(text)

