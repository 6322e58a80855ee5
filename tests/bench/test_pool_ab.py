"""bench/pool_ab.py and profiler.abstats.pooled_stats: several paired on/off runs as one estimate."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.abstats import paired_stats, pooled_stats

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "pool_ab.py"


def test_two_identical_runs_pool_to_their_mean_with_a_narrower_interval():
    ratios = [0.98, 1.00, 0.97, 0.99, 1.01, 0.98]
    alone, pooled = paired_stats(ratios, [1.0] * 6), pooled_stats([ratios, ratios])
    assert pooled["mean_diff_pct"] == pytest.approx(alone["mean_diff_pct"], abs=1e-12)
    assert pooled["q"] == pytest.approx(0.0, abs=1e-12) and pooled["i2"] == 0.0
    assert pooled["n"] == 12 and pooled["runs"] == 2
    # sqrt(2) narrower on the log scale, less the t quantile's gain from 10 df against 5
    logs = [math.log(r) for r in ratios]
    sd = math.sqrt(sum((x - sum(logs) / 6) ** 2 for x in logs) / 5)
    assert math.log(1 + pooled["ci_high_pct"] / 100) - math.log(1 + pooled["mean_diff_pct"] / 100) == \
        pytest.approx(pooled["t_quantile"] * sd / math.sqrt(12), rel=1e-9)


def test_the_more_precise_run_weighs_more_and_disagreement_shows_in_q():
    tight = [0.990, 0.991, 0.989, 0.990, 0.991, 0.989]     # -1% +- little
    loose = [1.05, 0.95, 1.10, 0.90, 1.04, 0.98]           # about 0 +- much
    pooled = pooled_stats([tight, loose])
    assert -1.0 < pooled["mean_diff_pct"] < -0.9
    apart = pooled_stats([tight, [r + 0.02 for r in tight]])
    assert apart["q"] > 100 and apart["i2"] > 0.99
    with pytest.raises(ValueError, match="2 pairs or more"):
        pooled_stats([[1.0]])
    with pytest.raises(ValueError, match="no spread"):
        pooled_stats([[1.0, 1.0]])


def test_the_script_pools_matching_runs_and_refuses_bad_input(tmp_path):
    def run_of(part, ratios, inject=0.0):
        return {"workload": "launch", "part": part, "inject_s": inject, "run_dir": f"/x/{part}{inject}/launch",
                "result": {"paired": {"ratios": ratios}, "off": {"mean": 50.0}}}
    good = tmp_path / "a.json"
    good.write_text(json.dumps({"runs": [run_of("all", [0.99, 0.98, 1.0]), run_of("gpu", [1.0, 1.01]),
                                         run_of("all", [0.9, 0.91], inject=0.0002)]}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(good), str(good)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("| a.json:") == 2 and "**pooled, 2 runs** | 6 |" in out.stdout
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    out = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.strip().startswith(f"pool_ab: {bad}: cannot read it as an ab_inrun JSON")
    out = subprocess.run([sys.executable, str(SCRIPT), "--part", "inline", str(good)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "pool_ab: no launch run of part inline without injected cost in 1 file(s)"


@pytest.mark.parametrize("ratios, says", [([1.0, 0, "x"], "a ratio that is not a positive finite number"),
                                          ([1.0, 1.0], "no spread to weigh")])
def test_the_script_refuses_ratios_it_cannot_pool_with_one_line(tmp_path, ratios, says):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"runs": [{"workload": "launch", "part": "all", "run_dir": "/x/y/z",
                                       "result": {"paired": {"ratios": ratios}}}]}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("pool_ab: ") and says in out.stderr
