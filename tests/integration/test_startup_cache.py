"""Issue 37 item 1: a second default run starts in seconds. The session's shared healthy run is the README
default run on a fresh user cache (tests/conftest.py points XDG_CACHE_HOME at one), so it built the built-ins;
a second default run, on the same cache, copies them: timed to its first step against the first."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.schema.records import read_records

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def startup(run: Path) -> dict:
    """Rank 0's `startup` event: where its time went from launch to its first step."""
    recs, _ = read_records(run / "profile" / "rank0.jsonl")
    return next(r for r in recs if r.get("type") == "event" and r.get("kind") == "startup")


def test_a_second_default_run_copies_the_built_ins_and_reaches_its_first_step_in_seconds(healthy_run, tmp_path):
    """The second run's built-ins phase (a copy of the cache entry and a tokenizer load) is a small part of the
    first's (building the target and generating 1,000 + 16 conversations), and so is its whole start-up; it still
    carries the target and corpus it trained against, byte for byte the first run's. (The figures under 15 s
    are bench/RESULTS.md's, measured on an idle machine: here the suite's other tests share the cores.)"""
    cold = startup(healthy_run.run)
    warm_run = tmp_path / "warm"
    # the README default run's settings (--eval-prompts 0 keeps its 16 held-out prompts: the same cache entry)
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(warm_run), "--max-steps", "2",
                        "--eval-prompts", "0", "--metrics-port", "0"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    warm = startup(warm_run)
    built, copied = cold["phases_seconds"]["built-ins"], warm["phases_seconds"]["built-ins"]
    assert built > 5.0, cold          # it did build: a target and a thousand greedy continuations
    assert copied < built / 10, (cold, warm)
    assert warm["total_seconds"] < cold["total_seconds"] - built / 2, (cold, warm)
    assert f"built-ins {copied:.1f}" in r.stdout   # rank 0's start-up line says so
    cmp = filecmp.dircmp(warm_run / "builtin", healthy_run.run / "builtin")
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files
    assert filecmp.cmp(warm_run / "builtin" / "tiny-target" / "model.safetensors",
                       healthy_run.run / "builtin" / "tiny-target" / "model.safetensors", shallow=False)
