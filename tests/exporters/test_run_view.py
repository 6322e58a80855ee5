"""The run's view in the per-rank sinks (exporters/run_view.py): the whole run's verdict, findings and steady
figures, read back by TensorBoard's own reader from the session's healthy run (`--sinks tensorboard`), and by
wandb's from a view written offline; every figure equals the report's."""
from __future__ import annotations

import json

import pytest

from dflash.advice import ADVICE
from exporters.run_view import run_view, write_wandb
from profiler import report

REPORT = {"verdict": {"verdict": "drafter-bound",
                      "roles": {"drafter": {"window": "steady intervals (8)", "wall_seconds": 8.0},
                                "target": {"window": "steady intervals (9)", "wall_seconds": 9.0}},
                      "evidence": ["target waits 41% on transfer.wait_slot"]},
          "findings": [{"summary": "the drafter bounds the run", "next": "--drafter-gpus 2"}],
          "steady": {"roles": {"drafter": {"window": "steady state", "steady_tokens_per_s": 871.5,
                                           "steady_model_flops_per_s": 4.3e9, "steady_seconds": 9.2,
                                           "steady_steps": 9, "mfu": {"measured": 0.13, "datasheet": None}},
                               "target": {"window": "all intervals (none steady)", "steady_tokens_per_s": None}}}}


def test_the_view_holds_the_reports_verdict_findings_and_steady_figures_under_their_window():
    view = run_view(REPORT, 40)
    assert view.step == 40 and view.verdict == "drafter-bound"
    assert view.texts["run/verdict"] == ("**drafter-bound** (read over drafter: steady intervals (8), 8 s; target: "
                                         "steady intervals (9), 9 s)\n\n- target waits 41% on transfer.wait_slot")
    assert view.texts["run/findings"] == "1. the drafter bounds the run  \n   next: --drafter-gpus 2"
    assert view.texts["run/steady_window"] == ("- drafter: steady state, 9.2 s, 9 steps\n"
                                               "- target: all intervals (none steady)")
    assert view.scalars == {"steady/tokens_per_s/drafter": 871.5, "steady/model_flops_per_s/drafter": 4.3e9,
                            "steady/mfu/drafter/measured": 0.13}   # no figure where the report has none
    empty = run_view({**REPORT, "findings": [], "verdict": {**REPORT["verdict"], "verdict": None}}, 1)
    assert empty.texts["run/findings"] == "none" and empty.verdict == "none"


def _tensorboard(logdir) -> tuple[dict, dict]:
    """({tag: [(step, value)]}, {tag: [(step, text)]}) as TensorBoard's EventAccumulator reads the directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts = {t.removesuffix("/text_summary"): [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
                                               for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}
    return scalars, texts


def test_rank_0_writes_the_runs_view_beside_the_ranks_own_in_tensorboard(healthy_run):
    pytest.importorskip("tensorboard")
    assert healthy_run.returncode == 0, healthy_run.stderr[-2000:]
    run = healthy_run.run
    assert f"run view: {run / 'tensorboard' / 'run'}" in healthy_run.stdout
    rep = report.hotspots(run, advice=ADVICE)   # what rank 0 handed over, made again from the same logs
    step = max(r["step"] for rank in (0, 1) for r in map(json.loads, (run / "profile" / f"rank{rank}.jsonl")
                                                          .read_text().splitlines()) if r["type"] == "run_end")
    want = run_view(rep, step)
    scalars, texts = _tensorboard(run / "tensorboard" / "run")
    assert texts == {tag: [(step, text)] for tag, text in want.texts.items()}
    assert set(scalars) == set(want.scalars) and "steady/tokens_per_s/drafter" in scalars
    for tag, value in want.scalars.items():
        assert scalars[tag] == [(step, pytest.approx(value, rel=1e-6))], tag   # float32 in the event file
    assert rep["verdict"]["verdict"] and f"**{rep['verdict']['verdict']}**" in texts["run/verdict"][0][1]


def test_the_runs_view_is_a_wandb_run_in_the_runs_group(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    from tests.exporters.test_wandb import _read

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    view = run_view(REPORT, 40)
    root = write_wandb(tmp_path / "run", "run-7", view, 30.0)
    wandb.teardown()
    (got,) = _read([root])
    assert got["run"]["display_name"] == "run" and got["run"]["run_group"] == "run-7"
    assert got["run"]["job_type"] == "run"
    summary = {item["key"]: json.loads(item["value_json"]) for item in got["summary"]} \
        if isinstance(got["summary"], list) else got["summary"]
    assert summary["verdict"] == "drafter-bound"
    for tag, text in view.texts.items():
        assert summary[tag] == text
    for tag, value in view.scalars.items():
        assert summary[tag] == value
    assert got["history"] and got["history"][0][0] == 40
