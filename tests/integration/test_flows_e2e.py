"""Flows that match on a real two-rank CPU run with 5 s profile intervals (the session's healthy run covers 1 s:
tests/integration/test_exporters_e2e.py): the target's and the drafter's detail windows hold the same batches,
so the merged trace pairs at least 95% of its sends with their receives, and each rank's own trace file
carries its halves under the ids of those pairs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from report.trace import merge_traces

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128",
        "--device", "cpu", "--metrics-port", "0", "--profile-interval", "5", "--max-steps", "40"]


def flow_points(path: Path) -> dict:
    """{(ph, flow): id} of a trace file's flow events."""
    events = json.loads(path.read_text())["traceEvents"]
    return {(e["ph"], e["args"]["flow"]): e["id"] for e in events if e.get("ph") in ("s", "f")}


def test_flows_match_at_5_s_intervals(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *ARGS], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = merge_traces(run, tmp_path / "merged.json")
    windows = [json.loads(line) for line in (run / "profile" / "rank1.jsonl").read_text().splitlines()]
    assert len([w for w in windows if w.get("type") == "spans"]) >= 2, "the run closed fewer than two windows"
    assert summary["flow_sends"] >= 6 and summary["flow_receives"] >= 6, summary
    assert summary["flows_matched"] >= 0.95 * summary["flow_sends"], summary
    pairs = flow_points(tmp_path / "merged.json")
    halves = {**flow_points(run / "trace" / "rank0.json"), **flow_points(run / "trace" / "rank1.json")}
    assert {k for k in halves if k[0] == "s"} >= {k for k in pairs if k[0] == "s"}
    assert all(halves[k] == v for k, v in pairs.items())
