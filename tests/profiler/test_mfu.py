"""Model FLOP/s and MFU, one definition for every surface: the meter's steady window (dflash/throughput.py), the
role's MFU over its ranks' summed peaks (profiler/schema/windows.py), and the console's and report's one wording."""
from __future__ import annotations

import json

import pytest
import torch

from dflash.throughput import ThroughputMeter
from exporters.console import format_steady
from profiler.schema.windows import compute_clause, mfu, steady_throughput, summed_mfu

H100 = {"datasheet": {"flops_per_s": 989.4e12, "what": "datasheet dense bf16 (H100/H200 SXM)"},
        "measured": {"flops_per_s": 700e12, "what": "bf16 8192x8192x8192 matmul, best of 5 at the rank's start"}}


def _meter(tmp_path, monkeypatch, clock: list) -> ThroughputMeter:
    times = iter(clock)
    monkeypatch.setattr(ThroughputMeter, "_now_s", lambda self: next(times))
    return ThroughputMeter(tmp_path, 0, torch.device("cpu"), "drafter", warm_steps=2, start_step=0)


def test_the_steady_window_holds_the_model_flops_rate_beside_the_tokens(tmp_path, monkeypatch):
    meter = _meter(tmp_path, monkeypatch, [10.0, 30.0])
    for step in range(1, 7):
        meter.after_step(step, tokens_total=100 * step, model_flops_total=1e12 * step)
    meter.finish(6, tokens_total=600, model_flops_total=6e12)
    out = json.loads((tmp_path / "throughput" / "rank0.json").read_text())
    assert out["steady_tokens_per_s"] == 400 / 20.0 and out["steady_steps"] == 4
    assert out["steady_model_flops"] == 4e12 and out["steady_model_flops_per_s"] == 4e12 / 20.0
    assert steady_throughput([{"kind": "throughput", **out}])["steady_model_flops_per_s"] == 2e11


def test_a_loop_that_counts_no_flops_writes_no_flops_rate(tmp_path, monkeypatch):
    meter = _meter(tmp_path, monkeypatch, [10.0, 30.0])
    for step in range(1, 7):
        meter.after_step(step, tokens_total=100 * step)
    meter.finish(6, tokens_total=600)
    out = json.loads((tmp_path / "throughput" / "rank0.json").read_text())
    assert "steady_model_flops_per_s" not in out
    assert steady_throughput([{"kind": "throughput", **out}])["steady_model_flops_per_s"] is None


def test_mfu_is_each_peak_the_ranks_have_and_a_role_sums_rates_over_summed_peaks():
    assert mfu(98.94e12, H100) == {"datasheet": pytest.approx(0.1), "measured": pytest.approx(98.94 / 700)}
    assert mfu(None, H100) == {} and mfu(1e12, {}) == {}
    assert mfu(1e12, {"datasheet": {"flops_per_s": 0}, "measured": {"what": "x"}}) == {}
    cpu = {"measured": {"flops_per_s": 1e11, "what": "float32 256x256x256 matmul"}}
    role = summed_mfu([(100e12, H100), (300e12, H100), (5e10, cpu)])
    assert role["datasheet"] == pytest.approx(400e12 / (2 * 989.4e12))   # the CPU rank has no datasheet peak
    assert role["measured"] == pytest.approx((400e12 + 5e10) / (1400e12 + 1e11))
    assert summed_mfu([(0.0, H100)]) == {"datasheet": 0.0, "measured": 0.0}


def test_the_console_and_the_report_say_it_in_one_wording():
    said = compute_clause(98.94e12, {"datasheet": 0.1}, {"datasheet": H100["datasheet"]["what"]})
    assert said == "model 98.9 TFLOP/s, MFU 10.0% of datasheet dense bf16 (H100/H200 SXM)"
    assert compute_clause(2.5e9, {}, {}) == "model 2.5 GFLOP/s"
    assert compute_clause(None, {"datasheet": 0.1}, {}) == ""
    events = [{"type": "event", "kind": "throughput", "rank": r, "role": "drafter", "steady_tokens_per_s": 1000.0,
               "steady_steps": 10, "steady_seconds": 20.0, "warmup_steps": 5, "phases_seconds": {},
               "steady_model_flops_per_s": rate} for r, rate in ((0, 100e12), (1, 300e12))]
    line, = format_steady(events, peaks={0: H100, 1: H100})
    assert line.endswith("; model 400 TFLOP/s, MFU 20.2% of datasheet dense bf16 (H100/H200 SXM), 28.6% of "
                         "measured (bf16 8192x8192x8192 matmul, best of 5 at the rank's start)"), line
    assert "TFLOP" not in format_steady([{**e, "steady_model_flops_per_s": None} for e in events])[0]
