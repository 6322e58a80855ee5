"""Issue #49, the numerics early warning in real 2-rank CPU runs of dflash-train: an injected drift (DFLASH_FAULT
drift@SPAN:step=20,factor=4, growing x4 a step until it overflows) and a learning rate high enough for the numbers to
overflow each get a `numerics_drift` event naming the stage at least 5 steps before the run's first non-finite
value (its first `nonfinite` event); healthy runs (the session's and one more seed, resumed) get none. Each run
stops at its first non-finite value (--on-nonfinite stop, the default)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.schema import views
from profiler.runlog import read_records

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128",
         "--profile-interval", "2", "--device", "cpu", "--metrics-port", "0"]
LEAD_STEPS = 5
DIVERGING_LR = "3000"
"""On this run's settings (2026-12 CPU, 60 steps): lr 100, 300 and 1000 never reach a non-finite value; 3000 reaches
one at step 24 (the gradient norm), 1e4 at step 6, 1e5 and above at step 1. At 3000 the drafter's first layer
output jumps from 0.04 to 1e17 in the first update, inside the learning-rate warm-up (no baseline yet), and then
creeps (x1.1 a step, too slow for a growth warning) past sqrt(float32 max), where its norms' squares overflow: the
square_range rule, which needs no baseline, names it."""


def train(run: Path, args: list, fault: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *SMALL, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=400, env=dict(os.environ, DFLASH_FAULT=fault))


def events(run: Path, kind: str) -> list:
    out = []
    for log in sorted((run / "profile").glob("rank*.jsonl")):
        recs, _ = read_records(log)
        out += [views.event(r) for r in recs if r.get("type") == "event" and r.get("kind") == kind]
    return out


def first_nonfinite_step(run: Path) -> int:
    found = events(run, "nonfinite")
    assert found, "the run never reached a non-finite value: the proof needs one"
    return min(e.step for e in found)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prebuilt):
    """name -> (run directory, completed process), each run made once for the module's tests."""
    made: dict = {}

    def run(name: str, args: list, fault: str = ""):
        if name not in made:
            d = prebuilt(tmp_path_factory.mktemp(name) / "run")
            made[name] = d, train(d, args, fault)
        return made[name]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("span", ["target.pack_hidden", "drafter.fwd_bwd"])
def test_an_injected_drift_is_named_at_least_5_steps_before_the_first_nonfinite_value(runs, span):
    run, done = runs(span, ["--max-steps", "100"], f"drift@{span}:step=20,factor=4")
    assert done.returncode == 1 and "non-finite" in done.stderr, done.stderr[-3000:]
    first = first_nonfinite_step(run)
    named = [e for e in events(run, "numerics_drift") if e.span == span]
    assert named, [(e.span, e.tensor, e.step) for e in events(run, "numerics_drift")]
    w = min(named, key=lambda e: e.step)
    assert w.step <= first - LEAD_STEPS and w.step >= 20, (w.step, first)
    assert w.rule == "growth" and w.growth_per_step > 1.19 and w.steps_to_overflow > 0
    assert w.policy == "warn" and w.dtype == "float32" and len(w.window) == 2
    assert f"numerics drift: rank {w.rank} ({w.role}) step {w.step}: {span} {w.tensor}" in done.stderr
    report = subprocess.run([sys.executable, "-m", "dflash.report_cli", "hotspots", str(run)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert f"{span} {w.tensor}" in report.stdout and f"warned at step {w.step}" in report.stdout
    assert f"{first - w.step} steps before the first non-finite value" in report.stdout or (
        f"{first - min(e.step for e in events(run, 'numerics_drift'))} steps before" in report.stdout)


@pytest.mark.slow
def test_a_diverging_learning_rate_is_named_at_least_5_steps_before_the_first_nonfinite_value(runs):
    run, done = runs("lr", ["--max-steps", "40", "--lr", DIVERGING_LR])
    assert done.returncode == 1 and "non-finite" in done.stderr, done.stderr[-3000:]
    first = first_nonfinite_step(run)
    warned = events(run, "numerics_drift")
    assert warned and all(e.role == "drafter" for e in warned)
    w = min(warned, key=lambda e: e.step)
    assert w.step <= first - LEAD_STEPS, (w.step, w.span, w.tensor, first)
    assert w.rule == "square_range" and w.span == "drafter.fwd_bwd", (w.rule, w.span, w.tensor)


@pytest.mark.slow
def test_healthy_runs_raise_no_warning(healthy_run, runs):
    """The session's default run, and seed 1 stopped at step 30 and resumed to 50: warm-up, the loss falling
    fast at the start, the learning-rate warm-up's end and the resume all stay quiet."""
    assert events(healthy_run.run, "numerics_drift") == []
    logs = [views.interval(r) for r in read_records(healthy_run.run / "profile" / "rank0.jsonl")[0]
            if r.get("type") == "interval"]
    assert any(rec.numerics.stages for rec in logs)   # it was watched
    run, done = runs("seed1", ["--seed", "1", "--max-steps", "30"])
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = train(run, ["--resume", "--max-steps", "50"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert events(run, "numerics_drift") == [] and events(run, "nonfinite") == []
    assert "numerics drift" not in done.stderr + resumed.stderr
