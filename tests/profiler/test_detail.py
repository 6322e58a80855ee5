"""The detail window (profiler/detail.py): the producer's step rule, a follower's marked steps, spans kept by
their `detail` tag, a step longer than the interval, the span bound; then the same through a real Profiler.

Crafted records are the collector's finished CPU records: (name, t0_ns, t1_ns, depth, bytes, id, parent, attrs)."""
from __future__ import annotations

import threading

import pytest

import profiler
from profiler import api
from profiler.detail import MAX_RANGES, DetailWindow, StepMarks
from profiler.schema.records import read_records
from profiler.spans import SpanRecord
from tests.profiler.build import make_profiler


def rec(name, t0, t1, sid=None, attrs=None):
    return SpanRecord.of(name, t0, t1, 0, None, t0 if sid is None else sid, None, attrs)


def window(steps=2, follows=False, **kw):
    marks = StepMarks()
    return marks, DetailWindow(steps, marks, lambda t: t, {"main": 11}, follows=follows, **kw)


def run_steps(marks, win, steps, span_name="x.step", thread="main"):
    """Mark each step at t = step * 100 and finish one span inside it at t + 1 .. t + 2."""
    for step in steps:
        marks.mark(step * 100, step)
        win.offer([(thread, rec(span_name, step * 100 + 1, step * 100 + 2), None)])


def starts(got):
    return [s["start_unix_ns"] for s in got["spans"]]


def test_producer_window_starts_after_each_interval_opens_and_aligns_once_intervals_are_long():
    marks, win = window(steps=3)
    seen = []
    for step in range(20):                            # interval 0: the window is its first three steps
        marks.mark(step * 100, step)
        seen.append(marks.in_window)
        win.offer([("main", rec("x.step", step * 100 + 1, step * 100 + 2), None)])
    assert seen == [True] * 3 + [False] * 17
    got = win.take()
    assert got["steps"] == [0, 2] and starts(got) == [1, 101, 201] and got["dropped"] == 0
    run_steps(marks, win, range(20, 40))              # interval 1 ran 20 >= 2 x 8 steps: waits for step 24
    got = win.take()
    assert got["steps"] == [24, 26] and starts(got) == [2401, 2501, 2601]
    assert got["spans"][0] == {"id": 2401, "parent": None, "name": "x.step", "thread": "main", "tid": 11,
                               "depth": 0, "start_unix_ns": 2401, "end_unix_ns": 2402, "cpu_seconds": 1e-9,
                               "gpu_seconds": None, "bytes": None}
    run_steps(marks, win, range(40, 45))              # 5 steps < 16: the next window starts at once
    got = win.take()
    assert got["steps"] == [40, 42]
    marks.mark(4500, 44)                              # the same step again is no step change
    run_steps(marks, win, range(45, 47))
    assert win.take()["steps"] == [45, 46]


def test_a_window_longer_than_its_interval_runs_its_steps_and_the_next_waits_for_it():
    marks, win = window(steps=3)
    run_steps(marks, win, [0])
    assert win.take()["steps"] == [0, 0]           # closed mid-window
    run_steps(marks, win, [1])
    assert win.take()["steps"] == [1, 1]           # two intervals opened during the window
    run_steps(marks, win, [2, 3, 4])
    got = win.take()
    assert got["steps"] == [2, 4] and starts(got) == [201, 301, 401]   # 0-2, then 3 starts the next one


def test_follower_keeps_only_the_marked_steps_from_their_set_step_on():
    marks, win = window(steps=3, follows=True)
    kept = []
    for step in range(10):
        marks.mark(step * 100, step)
        # the step's first span (its receive) finished before the caller knew what it received
        win.offer([("main", rec("d.recv", step * 100 + 1, step * 100 + 10), None)])
        if step in (4, 5, 8):
            marks.keep_step()
            marks.keep_step()                         # twice in one step: one range
        kept.append(marks.in_window)
        win.offer([("main", rec("d.fwd", step * 100 + 20, step * 100 + 30), None)])
    assert kept == [s in (4, 5, 8) for s in range(10)]
    got = win.take()
    assert [(s["name"], s["start_unix_ns"]) for s in got["spans"]] == [
        ("d.fwd", 420), ("d.fwd", 520), ("d.fwd", 820)]   # a receive finished before keep_step is judged then
    assert got["steps"] == [4, 8] and len(marks.range_steps) == 3
    run_steps(marks, win, range(10, 40))              # a follower never chooses steps of its own
    assert win.take() is None


def test_detail_tags_decide_whatever_step_a_span_begins_in():
    marks, win = window(steps=2)
    run_steps(marks, win, range(0, 4))                # window: steps 0 and 1, [0, 200)
    win.offer([
        ("sender", rec("t.send", 50, 60, attrs={"flow": "1:0", "detail": False}), None),   # in the window's time
        ("sender", rec("t.send", 250, 260, attrs={"flow": "1:1", "detail": True}), None),  # after it
        ("sender", rec("t.other", 150, 160, attrs={"flow": "1:9"}), None),                 # untagged: by time
    ])
    got = win.take()
    assert [(s["name"], s["start_unix_ns"]) for s in got["spans"]] == [
        ("x.step", 1), ("x.step", 101), ("t.other", 150), ("t.send", 250)]
    assert got["spans"][-1]["attrs"] == {"flow": "1:1", "detail": True} and got["steps"] == [0, 1]
    win.offer([("sender", rec("t.send", 450, 460, attrs={"detail": True}), None)])
    only_tagged = win.take()
    assert only_tagged["steps"] is None and starts(only_tagged) == [450]


def test_a_step_longer_than_the_interval_loses_nothing():
    """A window step's span open across two interval closes goes into the record of the interval it ends in."""
    marks, win = window(steps=1)
    marks.mark(0, 0)
    win.offer([("main", rec("x.fetch", 1, 5), None)])
    assert starts(win.take()) == [1]              # interval 0 closes while x.fwd (begun at 10) is open
    assert win.take() is None                     # interval 1: still open, nothing kept yet
    win.offer([("main", rec("x.fwd", 10, 2500), None)])
    marks.mark(2600, 1)                               # step 1 starts a new window (an interval opened)
    win.offer([("main", rec("x.fetch", 2601, 2605), None)])
    got = win.take()
    assert [(s["name"], s["start_unix_ns"]) for s in got["spans"]] == [("x.fwd", 10), ("x.fetch", 2601)]
    assert got["steps"] == [0, 1] and got["dropped"] == 0


def test_the_span_bound_counts_the_rest_and_old_ranges_are_forgotten():
    marks, win = window(steps=1, max_spans=2)
    marks.mark(0, 0)
    win.offer([("main", rec("x.s", t, t + 1), None) for t in range(1, 6)])
    got = win.take()
    assert len(got["spans"]) == 2 and got["dropped"] == 3
    for step in range(1, MAX_RANGES + 5):             # one window step per interval
        marks.mark(step * 100, step)
        win.take()
    assert len(marks.range_steps) == MAX_RANGES and len(marks.edges) == 2 * MAX_RANGES - 1
    win.offer([("main", rec("x.late", 1, 2), None),   # began in a forgotten range
               ("main", rec("x.late", (MAX_RANGES + 4) * 100 + 1, (MAX_RANGES + 4) * 100 + 2), None)])
    assert starts(win.take()) == [(MAX_RANGES + 4) * 100 + 1]


def make_prof(tmp_path, **kw):
    return make_profiler(tmp_path, interval_s=3600.0, measure_floors=False, control=False, background=False, **kw)


def spans_records(tmp_path) -> list:
    recs, _ = read_records(tmp_path / "profile" / "rank0.jsonl")
    return [r for r in recs if r["type"] == "spans"]


def test_a_profiler_follower_holds_the_producers_batches_and_its_sender_thread_sends(tmp_path):
    """Producer and follower in one process, one after the other: the follower keeps exactly the batches
    the producer marked, and the producer keeps its other thread's sends of those batches only."""
    marked = []
    producer = tmp_path / "producer"
    with make_prof(producer, detail_steps=2) as prof:
        assert not api.in_detail()
        sends = []
        for step in range(6):
            profiler.set_step(step)
            with profiler.span("t.fwd"):
                pass
            marked.append(api.in_detail())
            sends.append((step, api.in_detail()))
            if step == 3:
                prof.close_interval()

        def sender():
            for step, detail in sends:
                with profiler.span("t.send"):
                    profiler.tag(flow=f"1:{step}", detail=detail)
        t = threading.Thread(target=sender, name="t.sender")
        t.start()
        t.join()
    assert marked == [True, True, False, False, True, True]
    got = [s for r in spans_records(producer) for s in r["spans"]]
    assert sorted(s["attrs"]["flow"] for s in got if s["name"] == "t.send") == ["1:0", "1:1", "1:4", "1:5"]
    assert len([s for s in got if s["name"] == "t.fwd"]) == 4

    follower = tmp_path / "follower"
    with make_prof(follower, detail_steps=2, detail_follows=True) as prof:
        for step, detail in enumerate(marked):
            profiler.set_step(step)
            with profiler.span("d.recv"):
                profiler.tag(flow=f"1:{step}", detail=detail)
            if detail:
                api.keep_step()
            assert api.in_detail() == detail
            with profiler.span("d.fwd"):
                pass
    got = [s for r in spans_records(follower) for s in r["spans"]]
    assert sorted(s["attrs"]["flow"] for s in got if s["name"] == "d.recv") == ["1:0", "1:1", "1:4", "1:5"]
    assert len([s for s in got if s["name"] == "d.fwd"]) == 4
    start = next(r for r in read_records(follower / "profile" / "rank0.jsonl")[0] if r["type"] == "run_start")
    assert start["detail_follows"] is True and start["detail_steps"] == 2


def test_no_profiler_and_no_window(tmp_path):
    assert api.in_detail() is False
    api.keep_step()                               # no active profiler: nothing to keep into
    with make_prof(tmp_path, detail_steps=0) as prof:
        profiler.set_step(0)
        api.keep_step()
        assert not api.in_detail()
        prof.close_interval()
    assert spans_records(tmp_path) == []
    with pytest.raises(ValueError, match="detail_follows must be a bool"):
        profiler.ProfilerConfig(detail_follows=1)
