"""profiler.schema.windows.tick_windows: the cumulative `tick` records (docs/RUNLOG.md) as interval-shaped windows that
every accessor reads unchanged: changes between consecutive ticks of one segment, warm-up and final marks,
no window across a resume or between two ticks of one instant."""
from __future__ import annotations

import pytest

from profiler.schema.windows import basis_seconds, clock_seconds, is_steady, phase_share, self_seconds, span_clock, \
    tick_windows


def tick(index: int, t_s: float, spans: dict, tokens: float, step: int | None = None, **marks) -> dict:
    return {"type": "tick", "time_unix": 1000.0 + t_s, "rank": 0, "role": "drafter", "index": index, "t_s": t_s,
            "step": step, "counters": {"tokens": tokens}, "spans": spans, **marks}


def cpu(count: int, seconds: float, own: float | None = None) -> dict:
    return {"count": count, "cpu_seconds": seconds, "self_seconds": seconds if own is None else own}


def test_each_pair_of_ticks_is_a_window_of_their_changes():
    ticks = [tick(0, 0.0, {}, 0, warmup=True),
             tick(1, 5.0, {"fwd": cpu(10, 2.0, 1.5), "ckpt.save": cpu(0, 0.5)}, 500, 10),
             tick(2, 10.0, {"fwd": cpu(25, 5.0, 3.5), "ckpt.save": cpu(0, 0.5)}, 1500, 25, final=True)]
    first, second = tick_windows(ticks)
    assert first == {"index": 0, "start_s": 0.0, "end_s": 5.0, "duration_seconds": 5.0, "time_unix": 1005.0,
                     "step": 10, "source": "ticks", "warmup": True,
                     "spans": {"fwd": {"count": 10, "cpu": {"total_seconds": 2.0, "self_seconds": 1.5}, "gpu": None},
                               "ckpt.save": {"count": 0, "cpu": {"total_seconds": 0.5, "self_seconds": 0.5},
                                             "gpu": None}},
                     "counters": {"tokens": {"total": 500, "per_second": 100.0}}, "metrics": {}}
    # the unchanged ckpt.save is left out; the later tick's final mark, not the earlier's warm-up
    assert second["spans"] == {"fwd": {"count": 15, "cpu": {"total_seconds": 3.0, "self_seconds": 2.0}, "gpu": None}}
    assert second["final"] is True and "warmup" not in second and second["counters"]["tokens"]["per_second"] == 200.0
    # the accessors read them as intervals
    assert clock_seconds(second["spans"]["fwd"], "cpu") == 3.0 and self_seconds(second["spans"]["fwd"], "cpu") == 2.0
    assert phase_share(first, ("ckpt.save",)) == pytest.approx(0.1)
    assert not is_steady(first, ()) and not is_steady(second, ())


def test_gpu_times_are_scaled_to_all_spans_as_an_interval_s():
    g = {"count": 4, "cpu_seconds": 1.0, "self_seconds": 1.0, "gpu_seconds": 0.5, "gpu_self_seconds": 0.4,
         "gpu_count": 2}
    before = {"count": 0, "cpu_seconds": 0.0, "self_seconds": 0.0, "gpu_seconds": 0.0, "gpu_self_seconds": 0.0,
              "gpu_count": 0}
    (w,) = tick_windows([tick(0, 0.0, {"fwd": before}, 0), tick(1, 2.0, {"fwd": g}, 10)])
    e = w["spans"]["fwd"]
    assert e["gpu"] == {"total_seconds": 0.5, "self_seconds": 0.4} and e["gpu_count"] == 2
    assert span_clock([e]) == "gpu" and basis_seconds(e) == 1.0   # 0.5 s over 2 timed pairs, 4 spans
    # no CUDA pair resolved in a window: its time there is the CPU's
    (_, quiet) = tick_windows([tick(0, 0.0, {"fwd": before}, 0), tick(1, 2.0, {"fwd": g}, 10),
                               tick(2, 4.0, {"fwd": {**g, "count": 5, "cpu_seconds": 1.3, "self_seconds": 1.3}}, 20)])
    assert quiet["spans"]["fwd"]["gpu"] is None and "gpu_count" not in quiet["spans"]["fwd"]


def test_a_resume_starts_a_new_segment_and_one_instant_makes_no_window():
    ticks = [tick(0, 0.0, {}, 0), tick(1, 5.0, {}, 100),
             tick(0, 0.0, {}, 0), tick(1, 5.0, {}, 300), tick(2, 7.0, {}, 400), tick(3, 7.0, {}, 400, final=True)]
    windows = tick_windows(ticks)
    assert [(w["index"], w["start_s"], w["end_s"]) for w in windows] == [(0, 0.0, 5.0), (0, 0.0, 5.0), (1, 5.0, 7.0)]
    assert [w["counters"]["tokens"]["total"] for w in windows] == [100, 300, 100]   # never across the resume
    assert windows[-1].get("final") is True   # the final close at the timer tick's instant marks the window before
    assert tick_windows([]) == [] and tick_windows(ticks[:1]) == []


def test_a_window_s_metric_mean_is_the_change_of_the_sums_over_that_of_the_counts():
    """The finite values recorded between two ticks, an interval's metrics shape (readers take ["mean"]); a metric
    whose count did not move (nothing recorded, or only non-finite values) is left out of that window."""
    ticks = [tick(0, 0.0, {}, 0), tick(1, 5.0, {}, 500), tick(2, 10.0, {}, 1000), tick(3, 15.0, {}, 1500)]
    ticks[1]["metrics"] = {"loss": {"sum": 20.0, "count": 2}, "tau": {"sum": 3.0, "count": 2}}
    ticks[2]["metrics"] = {"loss": {"sum": 26.0, "count": 4}, "tau": {"sum": 3.0, "count": 2, "nonfinite": 1}}
    ticks[3]["metrics"] = {"loss": {"sum": 29.0, "count": 5, "nonfinite": 2}, "tau": {"sum": 6.0, "count": 3}}
    windows = tick_windows(ticks)
    assert [w["metrics"] for w in windows] == [{"loss": {"mean": 10.0}, "tau": {"mean": 1.5}}, {"loss": {"mean": 3.0}},
                                               {"loss": {"mean": 3.0}, "tau": {"mean": 3.0}}]
