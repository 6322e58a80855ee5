"""The statistics of bench/ab_profile.py (the profiling on/off A/B): t quantiles against published
tables, the paired interval and verdicts on numbers worked out by hand, the tail sizing and the
profiler share read from a run log."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "ab_profile.py"
_spec = importlib.util.spec_from_file_location("ab_profile", _PATH)
ab = sys.modules["ab_profile"] = importlib.util.module_from_spec(_spec)   # dataclasses look it up there
_spec.loader.exec_module(ab)


@pytest.mark.parametrize("df, expected", [(1, 12.706205), (2, 4.302653), (3, 3.182446), (5, 2.570582),
                                          (10, 2.228139), (30, 2.042272), (120, 1.979930)])
def test_t_quantile_matches_the_tables(df, expected):
    assert ab.t_quantile(0.975, df) == pytest.approx(expected, abs=2e-6)


def test_t_cdf_inverts_the_quantile_and_is_symmetric():
    for df in (1, 4, 17):
        t = ab.t_quantile(0.9, df)
        assert ab.t_cdf(t, df) == pytest.approx(0.9, abs=1e-10)
        assert ab.t_cdf(-t, df) == pytest.approx(0.1, abs=1e-10)


def test_paired_interval_on_known_numbers():
    # Log ratios ln(1.01), ln(0.99), ln(1.02), 0: n = 4, t(0.975, 3) = 3.182446.
    on, off = [101.0, 99.0, 102.0, 100.0], [100.0] * 4
    logs = [math.log(1.01), math.log(0.99), math.log(1.02), 0.0]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = 3.182446 * sd / 2
    p = ab.paired_stats(on, off)
    assert p["n"] == 4 and p["ratios"] == pytest.approx([1.01, 0.99, 1.02, 1.0])
    assert p["mean_diff_pct"] == pytest.approx(100 * (math.exp(mean) - 1))
    assert p["ci_low_pct"] == pytest.approx(100 * (math.exp(mean - half) - 1), rel=1e-6)
    assert p["ci_high_pct"] == pytest.approx(100 * (math.exp(mean + half) - 1), rel=1e-6)
    assert p["ci_low_pct"] == pytest.approx(-1.5397, abs=1e-3) and p["ci_high_pct"] == pytest.approx(2.5692, abs=1e-3)
    v = ab.verdicts(p)
    assert v["resolves"] is False and v["within"] == "undetermined"


def test_verdicts_yes_no_and_a_single_pair():
    tight_slow = ab.paired_stats([97.0, 97.1, 96.9, 97.0], [100.0] * 4)    # -3% +- 0.2%
    assert ab.verdicts(tight_slow)["resolves"] is True and ab.verdicts(tight_slow)["within"] == "no"
    tight_same = ab.paired_stats([99.9, 100.1, 100.0, 100.2], [100.0] * 4)
    assert ab.verdicts(tight_same)["resolves"] is True and ab.verdicts(tight_same)["within"] == "yes"
    single = ab.paired_stats([99.0], [100.0])
    assert single["ci_low_pct"] is None and ab.verdicts(single)["within"] == "undetermined"


def test_arm_stats():
    s = ab.arm_stats([90.0, 100.0, 110.0])
    assert (s["n"], s["mean"], s["median"], s["min"], s["max"]) == (3, 100.0, 100.0, 90.0, 110.0)
    assert s["cv"] == pytest.approx(0.1)


def test_steps_are_sized_so_the_tail_lasts_the_seconds_asked():
    # 100 steps at 1000 tokens each, a tail of 47 steps at 20,000 tokens/s: 20 steps/s
    meter = {"steps": 100, "tokens": 100_000, "tail_steps": 47, "tail_tokens_per_s": 20_000.0}
    assert ab.tail_seconds(meter) == pytest.approx(47 / 20)
    assert ab.steps_for_tail(meter, 15.0, 150) == 2 * 15 * 20 + ab.METER_WARM_STEPS
    assert ab.steps_for_tail(meter, 1.0, 150) == 150                  # never fewer than asked
    assert ab.steps_for_tail({"steps": 3}, 15.0, 150) is None and ab.tail_seconds({}) is None
    section = {"steps": 150, "runs": [{"warmup": True, "value": 1.0, "throughput": meter}]}
    setup = SimpleNamespace(tail_seconds=15.0)
    assert ab._size_steps(setup, "w", section, ["--x", "--max-steps", "150"]) == ["--x", "--max-steps", "605"]
    assert section["steps"] == 605
    assert ab._size_steps(SimpleNamespace(tail_seconds=0.0), "w", section, ["a"]) == ["a"]


def test_profiler_share_is_read_from_the_run_log_weighted_by_duration(tmp_path):
    (tmp_path / "profile").mkdir()
    recs = [{"type": "run_start"}, {"type": "interval", "duration_seconds": 5.0, "profiler_share": 0.01},
            {"type": "interval", "duration_seconds": 1.0, "profiler_share": 0.04},
            {"type": "interval", "duration_seconds": 2.0, "profiler_share": None}]
    (tmp_path / "profile" / "rank0.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n{truncated")
    assert ab.read_profiler_share(tmp_path, 0) == pytest.approx((0.05 + 0.04) / 6)
    assert ab.read_profiler_share(tmp_path, 1) is None


def test_reports_of_several_calls_pool_their_pairs(tmp_path):
    def report(path, values):
        runs = [{"arm": "on", "value": 9.0, "warmup": True}]
        for i, (on, off) in enumerate(values):
            runs += [{"arm": "on", "pair": i, "value": on}, {"arm": "off", "pair": i, "value": off}]
        path.write_text(json.dumps({"workloads": {"launch": {"name": "launch", "metric": "m", "rank": 0,
                                                              "steps": 150, "runs": runs}}}))
        return path

    merged = ab.merge_reports([report(tmp_path / "a.json", [(99.0, 100.0)]),
                               report(tmp_path / "b.json", [(98.0, 100.0), (100.0, 100.0)])])
    sec = merged["launch"]
    assert sec["summary"]["pairs"] == [0, 1, 2] and sec["steps"] == "150"
    assert sec["summary"]["paired"]["ratios"] == pytest.approx([0.99, 0.98, 1.0])
    assert "3 complete pairs" in ab.format_summary("launch", sec)


def test_merge_of_a_missing_or_foreign_file_is_one_line_and_exit_2(tmp_path, capsys):
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"workloads": {"x": {"runs": [{"pair": "a"}]}}}')
    for path in (tmp_path / "missing.json", foreign):
        assert ab.main(["--merge", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ab_profile: --merge: not a report of this script (")
