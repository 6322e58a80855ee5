"""The report over tick windows (issue 45): the README's main job (`--profile-interval 60`, 5 s ticks) reads its
verdict, wait shares and ranks from steady tick windows, never "none steady" beside a steady state; compare reads
both runs over one kind of window, concludes "regression" on a 30% slower drafter, lists every regression in its
summary and has a subcommand; the plot has a point per tick window and draws every line in time order; and the
check's invariants for each (simulated runs: tests/report/ticked.py)."""
from __future__ import annotations

import json

import pytest

from profiler import report
import profiler.report.check as check_mod
from dflash import report_cli
from profiler.report.check import check, check_compare
from profiler.report.plot import _window_words, timeline
from profiler.report.runs import load_run
from tests.report.test_check import write
from tests.report.ticked import ticked_run

NVML = {"available": True, "gpus": [{"index": 0, "name": "H200", "total_bytes": 140 * 2**30,
                                     "used_bytes_peak": 60 * 2**30, "headroom_bytes": 80 * 2**30}]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("ticked")
    return {"a": write(d / "a", ticked_run()), "slow": write(d / "slow", ticked_run(fwd_s=0.26, seed=2)),
            "old": write(d / "old", ticked_run(tick_s=None))}


def test_the_readme_run_reads_its_verdict_from_steady_tick_windows(runs):
    """One warm-up interval and one final: over intervals, "none steady" beside a 72 s steady state; over its
    5 s ticks, steady windows (the drafter's checkpoint window left out as a phase), and a verdict."""
    rep = report.hotspots(runs["a"])
    roles = rep["verdict"]["roles"]
    assert rep["verdict"]["verdict"] == "drafter-bound"
    assert (roles["drafter"]["window"], roles["target"]["window"]) == ("steady windows (12 x 5 s)",
                                                                     "steady windows (13 x 5 s)")
    assert roles["target"]["wait_share"] == pytest.approx(0.5, abs=0.05)
    text = report.format_hotspots(rep)
    assert "Verdict (drafter: steady windows (12 x 5 s), 60 s; target: steady windows (13 x 5 s), 65 s): " \
           "drafter-bound" in text
    assert "none steady" not in text and "warm-up tick windows 10.0 s" in text
    assert [r["window"] for r in rep["ranks"]["ranks"]] == ["steady windows (12 x 5 s)", "steady windows (13 x 5 s)"]
    assert check(runs["a"]).violations == []
    # the same run without ticks (a log written before them) reads as it did: over intervals, none steady
    old = report.hotspots(runs["old"])
    assert old["verdict"]["roles"]["drafter"]["window"] == "all 2 intervals (none steady: warm-up, phases or final)"
    assert check(runs["old"]).violations == []


def test_compare_concludes_regression_on_a_slower_drafter(runs):
    table = report.compare(runs["a"], runs["slow"])
    assert {"drafter/drafter.fwd_bwd", "tokens/s (drafter)"} <= set(table["regressions"])
    assert table["role_windows"]["drafter"] == {"a": "steady windows (12 x 5 s)", "b": "steady windows (12 x 5 s)"}
    assert (table["tokens_per_s"]["drafter"]["a"]["intervals"], table["tokens_per_s"]["drafter"]["b"]["intervals"]) \
        == (12, 12)   # the labels' counts
    text = report.format_compare(table)
    assert text.splitlines()[-1] == "Regressions: " + ", ".join(table["regressions"])
    assert "tokens/s (drafter)" in text.splitlines()[-1]
    assert check_compare(runs["a"], runs["slow"]).violations == []


def test_compare_reads_both_runs_over_one_kind_of_window(runs, tmp_path):
    """B without ticks: both runs over intervals; A with steady intervals and B none: both over all of them; a
    phase span in A's steady windows and out of B's is "too few windows", not "only in A"."""
    long_old = write(tmp_path / "long", ticked_run(tick_s=None, length_s=200.0))
    table = report.compare(long_old, runs["old"])
    assert table["role_windows"]["drafter"] == {
        "a": "all 4 intervals (read alike: the other run has no steady intervals)",
        "b": "all 2 intervals (none steady: warm-up, phases or final)"}
    assert report.compare(runs["a"], runs["old"])["role_windows"]["target"]["a"].startswith("all 2 intervals")
    short_ckpt = write(tmp_path / "short", ticked_run(ckpt_s=0.3))
    rows = {(r["role"], r["span"]): r for r in report.compare(short_ckpt, runs["a"])["spans"]}
    assert rows[("drafter", "ckpt.save")]["verdict"] == "too few windows"
    for a, b in ((long_old, runs["old"]), (runs["a"], runs["old"]), (short_ckpt, runs["a"])):
        assert check_compare(a, b).violations == []


def test_compare_is_a_subcommand(runs, capsys):
    assert report_cli.main(["compare", str(runs["a"]), str(runs["slow"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dflash-report compare  A ") and "Regressions: " in out and "tokens/s (drafter)" in out
    assert report_cli.main(["compare", str(runs["a"]), str(runs["slow"]), "--json"]) == 0
    assert "tokens/s (drafter)" in json.loads(capsys.readouterr().out)["regressions"]
    assert report_cli.main(["check", str(runs["slow"]), "--compare", str(runs["a"])]) == 0
    with pytest.raises(SystemExit) as e:
        report_cli.main(["compare", str(runs["a"])])
    assert e.value.code == 2


def test_the_plot_has_a_point_per_tick_window_and_lines_in_time_order(runs, tmp_path):
    tl = timeline(load_run(runs["a"]))
    assert tl["source"] == "ticks" and tl["window_s"] == 5.0
    for s in tl["roles"].values():
        assert len(s["seconds"]) >= 10 and s["seconds"] == sorted(s["seconds"])
    # two ranks on one GPU, their intervals closing apart: the headroom line runs forward in time
    run = ticked_run(tick_s=None, length_s=200.0)
    for rank, recs in run["logs"].items():
        for r in recs:
            if r["type"] == "interval":
                r["memory"] = NVML
                r["time_unix"] -= 30.0 * rank
    gpu = timeline(load_run(write(tmp_path / "gpu", run)))["gpus"]["h:0"]
    assert len(gpu["seconds"]) == 8 and gpu["seconds"] == sorted(gpu["seconds"])


def test_the_loss_panel_has_a_point_per_tick_window(runs, tmp_path):
    """The README run's two intervals would give the loss line 2 points; its ticks' cumulative loss sums give one
    mean per 5 s tick window (the finite values recorded in it), and the title says so."""
    tl = timeline(load_run(runs["a"]))
    drafter = tl["roles"]["drafter"]
    assert tl["metric_source"] == "ticks"
    losses = [v for v in drafter["metrics"]["loss"] if v is not None]
    assert len(losses) >= 10 and losses == sorted(losses, reverse=True)   # the simulated loss falls
    assert drafter["metric_seconds"] == sorted(drafter["metric_seconds"])
    assert "loss" not in tl["roles"]["target"]["metrics"]
    assert _window_words(tl, tl["metric_source"]) == "5 s tick window"
    # a log written before ticks carried metrics: the intervals' own, named so
    old = ticked_run()
    for r in (r for recs in old["logs"].values() for r in recs if r["type"] == "tick"):
        del r["metrics"]
    tl_old = timeline(load_run(write(tmp_path / "old", old)))
    assert tl_old["metric_source"] == "intervals" and len(tl_old["roles"]["drafter"]["metrics"]["loss"]) == 2
    assert _window_words(tl_old, tl_old["metric_source"]) == "60 s interval"


def test_the_check_names_a_compare_not_alike_and_a_label_beside_another_figure(runs, monkeypatch):
    real = check_mod.compare_runs

    def a_over_all(run_a, run_b):   # as before: A over all its intervals, B over steady windows
        table = real(run_a, run_b)
        table["role_windows"]["drafter"]["a"] = "all 2 intervals (none steady: warm-up, phases or final)"
        table["regressions"] = table["regressions"][:1]
        return table

    monkeypatch.setattr(check_mod, "compare_runs", a_over_all)
    found = {(v.invariant, v.where) for v in check_compare(runs["a"], runs["slow"]).violations}
    assert {("compare", "compare drafter A"), ("compare", "compare text Regressions")} <= found
    res = check_mod.CheckResult(run_dir="x")
    check_mod._expect_beside(res, "verdict", "Verdict (drafter: steady windows (12 x 5 s), 80 s): x",
                             "drafter: steady windows (12 x 5 s)", 60.0)
    assert [v.invariant for v in res.violations] == ["windows"]


def test_per_interval_figures_beside_steady_tick_windows_never_say_none_steady(tmp_path):
    """The drafters' queue depth is a gauge of the interval records only: on the README run (no steady interval,
    steady tick windows) it is named as the whole run's, not "none steady" beside the verdict's steady windows."""
    run = ticked_run()
    for r in run["logs"][0]:
        if r["type"] == "interval":
            r["gauges"] = {"queue_depth": {"mean": 1.5, "last": 1.0, "max": 2.0}}
    rep = report.hotspots(write(tmp_path / "run", run))
    depth = [e for e in rep["verdict"]["evidence"] if e.startswith("received batches")]
    assert depth == ["received batches waiting for the drafter: 1.50 on average (2 interval means; drafter: the whole "
                     "run (2 intervals, warm-up included: this figure is per interval only))"]
    assert "none steady" not in report.format_hotspots(rep)


def test_ticks_only_at_the_closes_leave_the_intervals_in_place(tmp_path):
    """tick_s at or above interval_s: a tick at each close only, no finer than the intervals, which keep their whole
    spans: the report reads the intervals and names them so."""
    rep = report.hotspots(write(tmp_path / "run", ticked_run(tick_s=60.0)))
    assert rep["verdict"]["roles"]["drafter"]["window"] == "all 2 intervals (none steady: warm-up, phases or final)"


def test_a_change_is_weighed_against_the_spread_of_the_mean():
    """Forty noisy 5 s windows a run (+-50%): a 30% slower B is beyond the range their mean varies over
    (spread / sqrt(n)) though well within the samples' spread; the same run against itself is within it."""
    import random

    from profiler.report.compare import classify

    rng = random.Random(7)
    a = [1.0 + rng.uniform(-0.5, 0.5) for _ in range(40)]
    b = [1.3 + rng.uniform(-0.5, 0.5) for _ in range(40)]
    slower = classify(a, b)
    assert slower["a"]["spread"] > 0.3 and slower["verdict"] == "regression"
    assert slower["a"]["mean_spread"] == pytest.approx(slower["a"]["spread"] / 40 ** 0.5)
    assert classify(a, list(a))["verdict"] == "within spread"
    # a span's mean weighs its windows by their calls: its total over its calls
    assert classify([2.0, 1.0], [2.0, 1.0], weights=([1, 3], [1, 3]))["a"]["mean"] == pytest.approx(1.25)


def test_a_tick_s_metrics_are_read_or_its_line_is_bad(runs, tmp_path):
    assert all(log.bad_lines == 0 for log in load_run(runs["a"]).ranks.values())
    run = ticked_run()
    ticks = [r for r in run["logs"][0] if r["type"] == "tick"]
    ticks[3]["metrics"] = {"loss": {"sum": "x", "count": 2}}
    ticks[4]["metrics"] = [1.0]
    ticks[5]["metrics"] = {"loss": 3.0}
    loaded = load_run(write(tmp_path / "bad", run))
    assert loaded.ranks[0].bad_lines == 3 and loaded.ranks[1].bad_lines == 0


def test_a_drafter_that_recompiles_all_along_is_read_past_warm_up_never_none_steady_beside_its_rate(tmp_path):
    """The H100 run of 2026-12-07 (300 steps, 10 s intervals): the drafter recompiled in every tick window, so none
    was steady by phases, while its steady state (compile time left out) read 48,161 tokens/s; the verdict said
    "none steady" beside it and `dflash-report check` exited 1. Its figures are now read over the windows past
    warm-up, labelled as each over a tenth in phases, and the check agrees."""
    run = write(tmp_path / "run", ticked_run(recompile_s=0.8))
    rep = report.hotspots(run)
    drafter = rep["verdict"]["roles"]["drafter"]
    assert drafter["window"].startswith("past-warm-up tick windows (")
    assert "each over a tenth in phases" in drafter["window"]
    assert rep["verdict"]["roles"]["target"]["window"].startswith("steady windows (")
    assert rep["steady"]["roles"]["drafter"]["steady_tokens_per_s"] > 0
    assert "none steady" not in report.format_hotspots(rep)
    assert check(run).violations == []


def test_a_wait_is_read_on_the_hosts_clock_never_over_the_wall(tmp_path):
    """A wait span with CUDA events whose GPU window, scaled from its timed instances to all of them, sums past the
    wall (the H100 run's "target waits 101%"): the verdict reads the wait on the CPU clock, cut at the windows'
    edges, and the check bounds every role's wait share by its wall."""
    data = ticked_run()
    for rec in data["logs"][1]:
        if rec["type"] == "tick" and "transfer.wait_slot" in rec["spans"]:
            s = rec["spans"]["transfer.wait_slot"]
            s.update(gpu_seconds=s["cpu_seconds"] * 1.5, gpu_self_seconds=s["cpu_seconds"] * 1.5,
                     gpu_count=max(1, s["count"]))
    run = write(tmp_path / "run", data)
    target = report.hotspots(run)["verdict"]["roles"]["target"]
    assert target["wait_share"] == pytest.approx(0.5, abs=0.05)
    assert check(run).violations == []


def test_a_p95_from_the_run_end_never_passes_the_rows_max(tmp_path):
    """A disk that filled mid-run (the CI run of 2026-12-07, beside two busy loops): the run_end holds the whole
    segment's spans, the log lost some intervals, so the row's exact p95 (the run_end's) passed the longest span of
    the intervals kept, and `check` found p95 > max. The row's max is the longest of both."""
    data = ticked_run()
    end = next(r for r in data["logs"][0] if r["type"] == "run_end")
    kept_max = end["spans"]["drafter.optim"]["cpu"]["max_seconds"]
    end["spans"]["drafter.optim"]["cpu"].update(p50_seconds=kept_max, p95_seconds=2 * kept_max,
                                                  max_seconds=3 * kept_max)
    end["run_log"] = {"error": "No space left on device", "dropped_records": 3}
    run = write(tmp_path / "run", data)
    row = next(r for r in report.hotspots(run)["spans"]["rows"] if r["span"] == "drafter.optim")
    assert (row["p95_seconds"], row["max_seconds"]) == pytest.approx((2 * kept_max, 3 * kept_max))
    assert [v for v in check(run).violations if v.invariant == "order"] == []
