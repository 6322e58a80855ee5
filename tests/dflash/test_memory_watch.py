"""Rank 0's memory forecast while the run trains (dflash/memory_watch.py, issue #50): the report's own figure over
the logs so far, said once on the console when it first has a basis and written as a `memory_forecast` event each
time it is worked out; a failing forecast is one line and never fails the run."""
from __future__ import annotations

import io
import time

import profiler
from dflash.memory_watch import MemoryForecastWatch, event_fields
from profiler.report import load_run
from profiler.report.memory_forecast import memory_forecast
from tests.profiler.build import make_profiler
from tests.report.test_memory_forecast import write_run


def _events(run_dir, kind):
    recs, _ = profiler.read_records(run_dir / "profile" / "rank0.jsonl")
    return [r for r in recs if r.get("type") == "event" and r.get("kind") == kind]


def _wait_for(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_the_forecast_is_said_once_and_written_as_events(tmp_path):
    logs = write_run(tmp_path / "logs")   # a finished GPU-shaped run's logs, as the watch would read them
    err = io.StringIO()
    with make_profiler(tmp_path / "prof", control=False, measure_floors=False, background=False,
                       interval_s=3600.0, floors={}):
        watch = MemoryForecastWatch(logs, interval_s=0.05, err=err).start()
        try:
            assert _wait_for(lambda: len(_events(tmp_path / "prof", "memory_forecast")) >= 2)
        finally:
            watch.close()
    want = event_fields(memory_forecast(load_run(logs)))
    got = _events(tmp_path / "prof", "memory_forecast")[0]
    assert got["settings"] == want["settings"] and got["steps"] == 60
    said = err.getvalue().splitlines()
    tokens = next(s for s in want["settings"] if s["flag"] == "--tokens-per-batch")
    assert len(said) == 2   # one line per setting, once
    assert any(f"--tokens-per-batch up to {tokens['largest']:,} fit (now 4096;" in line for line in said)


def test_a_failing_forecast_is_one_line(tmp_path):
    err = io.StringIO()
    watch = MemoryForecastWatch(tmp_path, interval_s=0.01, err=err,
                                forecast=lambda run_dir: 1 / 0).start()
    assert _wait_for(lambda: "not available" in err.getvalue())
    watch.close()
    assert err.getvalue() == "dflash-train: memory forecast: not available (ZeroDivisionError: division by zero)\n"


def test_the_memory_plan_recommends_the_forecasts_largest_rounded_down(tmp_path):
    from dflash.memory_watch import plan_lines
    logs = write_run(tmp_path / "logs")
    lines, code = plan_lines(logs)
    settings = {s["flag"]: s for s in memory_forecast(load_run(logs))["settings"]}
    tokens, anchors = settings["--tokens-per-batch"]["largest"], settings["--num-anchors"]["largest"]
    assert code == 0 and lines[0].startswith("memory plan (60 steps past warm-up; 5% of every GPU kept free):")
    assert lines[-1] == (f"recommended, each alone (the others at their planned values): --num-anchors {anchors // 8 * 8}; "
                         f"--tokens-per-batch {tokens // 256 * 256}")
    lines, code = plan_lines(write_run(tmp_path / "cpu", cuda=False))
    assert code == 1 and lines == ["memory plan: no forecast: no per-step allocator peaks: a CPU run, or a log "
                                   "written before them"]


def test_a_setting_capped_by_another_says_so_and_is_recommended_at_the_cap(tmp_path):
    from dflash.memory_watch import plan_lines
    from tests.report.test_memory_forecast import CELLS, SIZES
    logs = write_run(tmp_path / "logs", sizes={**SIZES, **CELLS}, caps={"--max-length": "--tokens-per-batch"})
    lines, code = plan_lines(logs)
    assert code == 0
    line = next(line for line in lines if line.startswith("  --max-length "))
    assert line.startswith("  --max-length up to 4,096 fit (capped by --tokens-per-batch 4,096; memory does not "
                           "limit it) (now 512;"), line
    assert "--max-length 4096" in lines[-1]


def test_dflash_profile_memory_says_the_reports_forecast_from_the_logs_so_far(tmp_path):
    from dflash.memory_watch import live_fields, live_lines
    logs = write_run(tmp_path / "logs")
    fields = live_fields(logs)
    assert fields == {**event_fields(memory_forecast(load_run(logs))), "error": None}
    tokens = next(s for s in fields["settings"] if s["flag"] == "--tokens-per-batch")
    assert live_lines(fields)[-1].startswith(f"memory forecast: --tokens-per-batch up to {tokens['largest']:,} fit "
                                            "(now 4096;")
    short = live_fields(write_run(tmp_path / "short", steps=14, interval_steps=7))
    assert live_lines(short) == ["memory forecast: none yet: too few steps past warm-up to forecast from: rank 0 "
                                 "has 7 (at least 8)"]


def test_the_loops_name_only_sizes_the_table_describes_for_their_role():
    """Each size a loop names is a MEMORY_SIZES entry of its role (a size the table lacks would be fitted but never
    scaled); dense attention adds the drafter's score cells, flex does not."""
    from dflash import pipeline
    from dflash.loops import drafter_sizes, target_sizes
    named = {"target": target_sizes(3, 512),
             "drafter": drafter_sizes(4096, 1024, "dense"), "drafter-flex": drafter_sizes(4096, 1024, "flex")}
    for who, sizes in named.items():
        role = who.split("-")[0]
        assert all(pipeline.MEMORY_SIZES[n]["role"] == role for n in sizes), (who, sizes)
    assert named["target"] == {"target_tokens": 1536, "target_attention_cells": 3 * 512 * 512}
    assert named["drafter"]["drafter_score_cells"] == 1024 * (4096 + 1024)
    assert "drafter_score_cells" not in named["drafter-flex"]
    described = {n for e in (target_sizes(1, 1), drafter_sizes(1, 1, "dense")) for n in e}
    assert described == set(pipeline.MEMORY_SIZES)   # and every entry is named by some loop


def test_a_failing_live_forecast_is_one_line_after_the_saved_snapshots(tmp_path):
    from dflash.memory_watch import live_fields, live_lines
    broken = live_fields(tmp_path, forecast=lambda run_dir, second_core: 1 / 0)
    assert live_lines(broken) == ["memory forecast: not available (ZeroDivisionError: division by zero)"]
