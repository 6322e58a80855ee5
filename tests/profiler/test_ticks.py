"""`tick` records (docs/RUNLOG.md): cumulative counters and span totals every tick_s and at every interval close,
open spans' elapsed time included, so the difference of two ticks is a window as exact as an interval."""
import math
import time

import pytest

import profiler
from profiler.config import ProfilerConfig
from profiler.intervals import IntervalAggregator
from profiler.report.runs import load_run
from tests.profiler.build import make_profiler

LONG = "drafter.compile"


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def ticks_of(prof) -> list:
    log, _ = profiler.read_records(prof.log_path)
    return [r for r in log if r["type"] == "tick"]


def intervals_of(prof) -> list:
    log, _ = profiler.read_records(prof.log_path)
    return [r for r in log if r["type"] == "interval"]


def diff(a: dict, b: dict, name: str, key: str) -> float:
    """b's cumulative value less a's (a span absent from a tick has had nothing yet)."""
    return b["spans"].get(name, {}).get(key, 0) - a["spans"].get(name, {}).get(key, 0)


def test_ticks_follow_the_clock_between_closes_and_each_close_writes_one(tmp_path):
    clock = FakeClock()
    with make_profiler(tmp_path, control=False, background=False, clock=clock, wall_clock=lambda: 1.7e9,
                       measure_floors=False, interval_s=20.0, tick_s=5.0, warmup_steps=2) as prof:
        for step in range(10):
            prof.set_step(step)
            profiler.count("tokens", 100)
            clock.t += 2.5
            prof.tick()
    ticks, intervals = ticks_of(prof), intervals_of(prof)
    # 5, 10, 15, 20 (close), 25 and the final close at 25.0 + nothing more
    assert [t["t_s"] - 1000.0 for t in ticks] == [5.0, 10.0, 15.0, 20.0, 25.0, 25.0]
    assert [t["index"] for t in ticks] == list(range(6))
    assert [t.get("final", False) for t in ticks] == [False] * 5 + [True]
    assert ticks[3]["t_s"] == intervals[0]["end_s"] and ticks[-1]["t_s"] == intervals[-1]["end_s"]
    assert ticks[3]["time_unix"] == intervals[0]["time_unix"]
    assert [t["step"] for t in ticks] == [1, 3, 5, 7, 9, 9]
    assert [t.get("warmup", False) for t in ticks] == [True, False, False, False, False, False]
    assert [t["counters"]["tokens"] for t in ticks] == [200, 400, 600, 800, 1000, 1000]


def test_a_tick_longer_than_the_interval_leaves_only_the_closes_ticks(tmp_path):
    clock = FakeClock()
    with make_profiler(tmp_path, control=False, background=False, clock=clock, wall_clock=lambda: 1.7e9,
                       measure_floors=False, interval_s=10.0, tick_s=30.0) as prof:
        for _ in range(8):
            clock.t += 5.0
            prof.tick()
    assert [t["t_s"] - 1000.0 for t in ticks_of(prof)] == [10.0, 20.0, 30.0, 40.0, 40.0]
    assert [t["step"] for t in ticks_of(prof)] == [None] * 5   # set_step never called


def test_ticks_are_cumulative_split_a_long_open_span_and_add_up_to_the_intervals(tmp_path):
    with make_profiler(tmp_path, control=False, background=False, measure_floors=False, interval_s=3600.0) as prof:
        span = profiler.span(LONG)
        span.__enter__()
        for _ in range(2):
            time.sleep(0.02)
            prof.collector.write_tick()                  # the span is open: its elapsed time so far
        time.sleep(0.02)
        prof.close_interval()
        time.sleep(0.02)
        prof.collector.write_tick()
        span.__exit__(None, None, None)
        for _ in range(3):
            with profiler.span("drafter.optim"):
                time.sleep(0.005)
            profiler.count("tokens", 10)
        prof.collector.write_tick()
    ticks, intervals = ticks_of(prof), intervals_of(prof)
    assert len(ticks) == 6 and ticks[2]["t_s"] == intervals[0]["end_s"]
    long_s = [t["spans"][LONG]["cpu_seconds"] for t in ticks]
    assert [t["spans"][LONG]["count"] for t in ticks] == [0, 0, 0, 0, 1, 1]
    assert all(b > a for a, b in zip(long_s[:4], long_s[1:4]))    # open: it grows with every tick
    for a, b in zip(ticks, ticks[1:]):
        for name in {*a["spans"], *b["spans"]}:
            for key in ("count", "cpu_seconds", "self_seconds"):
                assert diff(a, b, name, key) >= 0
        assert b["counters"].get("tokens", 0) >= a["counters"].get("tokens", 0)
        assert diff(a, b, LONG, "cpu_seconds") <= b["t_s"] - a["t_s"] + 1e-6   # one thread: at most all of it
    # a close's tick holds the closed intervals exactly; the pieces add up to the whole span
    for name in (LONG, "drafter.optim"):
        split = sum(i["spans"].get(name, {"cpu": {"total_seconds": 0.0}})["cpu"]["total_seconds"] for i in intervals)
        assert ticks[-1]["spans"][name]["cpu_seconds"] == pytest.approx(split, abs=1e-9)
        second = intervals[1]["spans"][name]["cpu"]["total_seconds"]
        assert diff(ticks[2], ticks[-1], name, "cpu_seconds") == pytest.approx(second, abs=1e-9)
    whole_s = intervals[1]["spans"][LONG]["cpu"]["max_seconds"]
    assert ticks[-1]["spans"][LONG]["cpu_seconds"] == pytest.approx(whole_s, abs=1e-9)
    assert ticks[-1]["counters"] == {"tokens": 30} and ticks[-1]["spans"]["drafter.optim"]["count"] == 3
    assert "gpu_seconds" not in ticks[-1]["spans"][LONG]   # no CUDA pair timed


def test_the_report_reads_a_log_with_ticks_without_a_bad_line(tmp_path):
    with make_profiler(tmp_path, control=False, background=False, measure_floors=False) as prof:
        with profiler.span("drafter.optim"):
            profiler.count("tokens", 5)
        prof.collector.write_tick()
    run = load_run(tmp_path)
    assert run.ranks[0].bad_lines == 0 and len(ticks_of(prof)) == 2


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_tick_s_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="tick_s must be a positive number of seconds"):
        ProfilerConfig(tick_s=bad)


def test_tick_metrics_are_cumulative_across_a_close_with_a_nan_counted_apart():
    """A tick's "metrics": the closed intervals' finite values plus the current interval's so far; a 0-dim tensor
    is read to a float in place by the tick (the close then finds floats); a NaN is counted apart, so the sum
    stays finite for every later tick while the interval's own mean is NaN (written null, with its reason)."""
    torch = pytest.importorskip("torch")
    agg = IntervalAggregator()
    agg.add_drained([("main", [], [(2, "loss", 4.0), (2, "loss", torch.tensor(2.0)), (2, "tau", 1.5)])])
    assert agg.tick_parts()["metrics"] == {"loss": {"sum": 6.0, "count": 2}, "tau": {"sum": 1.5, "count": 1}}
    assert all(type(v) is float for values in agg._metrics.values() for v in values)   # read once, by the tick
    assert agg.close_parts(1.0)["metrics"]["loss"] == {"last": 2.0, "mean": 3.0}
    assert agg.tick_parts()["metrics"]["loss"] == {"sum": 6.0, "count": 2}   # right after the close: closed totals
    agg.add_drained([("main", [], [(2, "loss", 6.0), (2, "loss", float("nan"))])])
    mid = agg.tick_parts()["metrics"]
    assert mid == {"loss": {"sum": 12.0, "count": 3, "nonfinite": 1}, "tau": {"sum": 1.5, "count": 1}}
    assert math.isnan(agg.close_parts(1.0)["metrics"]["loss"]["mean"])
    agg.add_drained([("main", [], [(2, "loss", 3.0)])])
    assert agg.tick_parts()["metrics"]["loss"] == {"sum": 15.0, "count": 4, "nonfinite": 1}


def test_ticks_carry_the_metrics_through_the_run_log(tmp_path):
    with make_profiler(tmp_path, control=False, background=False, measure_floors=False, interval_s=3600.0) as prof:
        profiler.metric("loss", 5.0)
        prof.collector.write_tick()
        prof.close_interval()
        profiler.metric("loss", 3.0)
        profiler.metric("loss", float("inf"))
        prof.collector.write_tick()
    ticks = ticks_of(prof)
    assert [t["metrics"]["loss"] for t in ticks] == [{"sum": 5.0, "count": 1}, {"sum": 5.0, "count": 1},
                                                     {"sum": 8.0, "count": 2, "nonfinite": 1},
                                                     {"sum": 8.0, "count": 2, "nonfinite": 1}]
    assert load_run(tmp_path).ranks[0].bad_lines == 0
