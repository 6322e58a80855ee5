"""bench/gpu/oom_bisect.py's CPU parts (issue #50's GPU proof runs it): the bisection brackets a boundary with the
plan's rounding, the table row judges the forecast as the issue does (within 10%, never more than 5% above), and
the fixture it keeps of a run's logs gives the forecast the same answer as the whole logs."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))

import oom_bisect  # noqa: E402
from profiler.report import load_run  # noqa: E402
from profiler.report.memory_forecast import memory_forecast  # noqa: E402
from tests.report.test_memory_forecast import write_run  # noqa: E402


def _args(**kw):
    return SimpleNamespace(**{"fits": 4096, "ooms": 65536, "within": 0.10, "max_runs": 8,
                              "dimension": "tokens-per-batch", **kw})


def test_the_bisection_brackets_the_boundary_in_multiples_of_the_plans_rounding():
    boundary, tried = 21000, []

    def run(size):
        tried.append(size)
        return {"size": size, "fits": size <= boundary, "oom": size > boundary, "rc": 0, "wall_s": 1.0,
                "last_step": 30, "ranks": {}, "tail": ""}
    lo, hi = oom_bisect.bisect(run, _args(), [], lambda **kw: None)
    assert lo <= boundary < hi and hi / lo <= 1.10
    assert tried[:2] == [4096, 65536] and all(s % 256 == 0 for s in tried[2:])
    lo, hi = oom_bisect.bisect(run, _args(ooms=16384), [], lambda **kw: None)
    assert (lo, hi) == (16384, None)   # nothing ran out: the largest tried is the boundary's lower end


def test_the_row_judges_the_forecast_against_the_boundary():
    def report(largest, cap=None):
        return {"memory_forecast": {"settings": [{"flag": "--tokens-per-batch", "largest": largest,
                                                  "capped_by": cap}]}}
    row = lambda rep, lo, hi: oom_bisect.table_row("tokens-per-batch", "--tokens-per-batch", rep, lo, hi)  # noqa: E731
    assert row(report(19000), 20000, 21000)["verdict"] == "within 10% and not above by more than 5%"
    assert row(report(21500), 20000, 21000)["verdict"] == "ABOVE the boundary by more than 5%"
    assert row(report(17000), 20000, 21000)["verdict"] == "more than 10% below the boundary"
    assert abs(row(report(19000), 20000, 21000)["error_pct"] + 5.0) < 1e-9
    capped = row(report(4096, {"flag": "--tokens-per-batch", "value": 4096, "memory_largest": None}), 4096, None)
    assert capped["verdict"].endswith("no run ran out up to 4096: agrees")
    assert row({"memory_forecast": {"reason": "a CPU run"}}, 20000, 21000)["verdict"] == "no figure: a CPU run"


def test_the_kept_fixture_gives_the_forecast_the_whole_logs_answer(tmp_path):
    run = write_run(tmp_path / "run")
    for path in (run / "profile").glob("rank*.jsonl"):   # what a real log holds beside memory
        with path.open("a") as f:
            f.write(json.dumps({"type": "tick", "time_unix": 9.0, "rank": 0, "t_s": 1.0, "counters": {}}) + "\n")
    fixture = oom_bisect.trim_logs(run, tmp_path / "fixture")
    assert memory_forecast(load_run(fixture)) == memory_forecast(load_run(run))
    kinds = {json.loads(line)["type"] for path in (fixture / "profile").glob("*.jsonl")
             for line in path.read_text().splitlines()}
    assert kinds == {"run_start", "interval"}
