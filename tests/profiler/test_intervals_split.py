"""A span longer than the interval (issue #14): its CPU time is split across the intervals it overlaps,
while its count, percentiles and histogram see it once, whole, where it ends; GPU time lands where its
events resolve. The console and `dflash-report hotspots` say which spans were still open at an
interval's end, and for how long."""
import io
import threading
import time

import pytest

from exporters.console import ConsoleExporter

import profiler
from exporters.console import format_interval, hotspot_rows
from profiler.report import format_hotspots, hotspots
from profiler.cuda_timing import EventPool
from profiler.intervals import IntervalAggregator
from profiler.spans import SpanRecord
from tests.profiler.build import make_profiler

LONG = "drafter.compile"


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)   # boundaries come from close_interval() alone
    return make_profiler(tmp_path, control=False, background=False, measure_floors=False, **kw)


def ns(seconds) -> int:
    """A record's seconds back in the nanoseconds they were computed from (exact below 2**53 ns)."""
    return round(seconds * 1e9)


def entries(recs, name):
    return [r["spans"].get(name) for r in recs]


def test_a_span_across_three_boundaries_is_split_exactly_and_counted_once_whole(tmp_path):
    with make_prof(tmp_path) as prof:
        span = profiler.span(LONG)
        span.__enter__()
        recs = []
        for _ in range(3):
            time.sleep(0.01)
            recs.append(prof.close_interval())          # three boundaries inside the span
        time.sleep(0.01)
        span.__exit__(None, None, None)
        recs.append(prof.close_interval())
    log, _ = profiler.read_records(prof.log_path)
    end = [r for r in log if r["type"] == "run_end"][-1]["spans"][LONG]
    *opened, ended = entries(recs, LONG)
    whole_s = ended["cpu"]["max_seconds"]
    assert whole_s >= 0.04
    # the pieces: begin -> B1, B1 -> B2, B2 -> B3 (open), B3 -> end (its remainder)
    assert sum(ns(e["cpu"]["total_seconds"]) for e in (*opened, ended)) == ns(whole_s)
    for rec, e in zip(recs[:3], opened):
        assert e["count"] == 0 and e["open_cpu_seconds"] == e["cpu"]["total_seconds"] > 0
        assert e["cpu"]["mean_seconds"] is None and e["cpu"]["max_seconds"] is None and sum(e["cpu"]["buckets"]) == 0
        assert e["threads"] == [threading.current_thread().name]
    for rec in recs[1:3]:                                # open over the whole interval: exactly all of it
        assert rec["spans"][LONG]["share"] == 1.0
        assert rec["spans"][LONG]["cpu"]["total_seconds"] == rec["duration_seconds"]
    assert recs[0]["spans"][LONG]["share"] < 1.0
    assert ended["count"] == 1 and ended["open_cpu_seconds"] == 0.0
    assert ended["cpu"]["mean_seconds"] == ended["cpu"]["p95_seconds"] == whole_s   # one whole span
    assert ended["cpu"]["total_seconds"] < whole_s                                 # only its remainder
    assert sum(ended["cpu"]["buckets"]) == 1
    assert all(e["share"] <= 1.0 for r in recs for e in r["spans"].values())
    # the run's aggregate: the pieces add up to the span, seen once
    assert end["count"] == 1 and end["cpu"]["mean_seconds"] == whole_s
    assert ns(end["cpu"]["total_seconds"]) == ns(whole_s)
    # the record's open_spans keep their documented shape (no ids or perf-clock begin times)
    assert set(recs[0]["open_spans"][0]["spans"][0]) == {"name", "depth", "open_seconds"}


def test_shares_stay_within_an_interval_and_pieces_add_up_with_a_busy_thread(tmp_path):
    stop = threading.Event()

    def work():
        while not stop.is_set():
            with profiler.span("w.step"):
                for _ in range(3):
                    with profiler.span("w.inner"):
                        time.sleep(0.0005)

    with make_prof(tmp_path) as prof:
        worker = threading.Thread(target=work, name="w0")
        worker.start()
        recs = []
        for _ in range(8):                       # boundaries land anywhere inside the worker's spans
            time.sleep(0.007)
            recs.append(prof.close_interval())
        stop.set()
        worker.join()
        recs.append(prof.close_interval())
    for name in ("w.step", "w.inner"):
        got = [e for e in entries(recs, name) if e]
        assert all(e["share"] <= 1.0 for e in got)
        assert any(e["open_cpu_seconds"] > 0 for e in got)                    # some boundary fell inside one
        split_s = sum(e["cpu"]["total_seconds"] for e in got)
        whole_s = sum(e["cpu"]["mean_seconds"] * e["count"] for e in got if e["count"])
        assert split_s == pytest.approx(whole_s, rel=1e-9, abs=1e-9)
        assert sum(sum(e["cpu"]["buckets"]) for e in got) == sum(e["count"] for e in got)


def rec(name, t0_ns, t1_ns, span_id):
    """A finished CPU record as SpanRecorder.drain() gives it."""
    return SpanRecord.of(name, t0_ns, t1_ns, 0, None, span_id, None, None)


def opened(name, t0_ns, span_id):
    return [{"thread": "T", "native_id": 1, "spans": [{"name": name, "depth": 0, "open_seconds": 0.0,
                                                       "id": span_id, "t0_ns": t0_ns}]}]


def test_a_span_ending_past_the_boundary_being_closed_carries_the_rest():
    agg = IntervalAggregator()
    s = 1_000_000_000
    a = agg.close_parts(1.0, 10 * s, opened("x.long", 9 * s, span_id=7))["spans"]["x.long"]
    # closing at 11 s, the drain (after the boundary was read) finds it ended at 11.5 s, and a span that
    # began after the boundary is open
    agg.add_drained([("T", [rec("x.long", 9 * s, 11 * s + s // 2, 7)], [])], boundary_ns=11 * s)
    b = agg.close_parts(1.0, 11 * s, opened("x.late", 11 * s + s // 4, span_id=8))["spans"]
    c = agg.close_parts(1.0, 12 * s, ())["spans"]["x.long"]
    assert (a["count"], ns(a["cpu"]["total_seconds"]), ns(a["open_cpu_seconds"])) == (0, s, s)
    assert (b["x.long"]["count"], ns(b["x.long"]["cpu"]["total_seconds"])) == (1, s)
    assert ns(b["x.long"]["cpu"]["max_seconds"]) == 2 * s + s // 2
    assert "x.late" not in b                                    # nothing of it lies before the boundary
    assert (c["count"], ns(c["cpu"]["total_seconds"]), c["share"]) == (0, s // 2, 0.5)
    end = agg.run_parts(3.0)["spans"]["x.long"]
    assert end["count"] == 1 and ns(end["cpu"]["total_seconds"]) == 2 * s + s // 2


class FakeEvent:
    """A CUDA event of a fake device timeline: complete once the device has reached its stamp."""
    def __init__(self, gpu):
        self.gpu, self.t = gpu, None

    def record(self, stream=None):
        self.t = self.gpu["now_ms"]

    def query(self):
        return self.t is not None and self.t <= self.gpu["done_ms"]

    def elapsed_time(self, end):
        return end.t - self.t


def test_gpu_time_is_not_split_and_lands_where_the_pair_resolves(tmp_path):
    gpu = {"now_ms": 0.0, "done_ms": -1.0}
    with make_prof(tmp_path, event_pool=EventPool(lambda: FakeEvent(gpu), prealloc=2)) as prof:
        with profiler.span(LONG):
            time.sleep(0.005)
            first = prof.close_interval()
            gpu["now_ms"] += 30.0                      # the kernels it enqueued
        second = prof.close_interval()                 # its CPU remainder; the pair is still pending
        time.sleep(0.03)                               # the GPU runs its 30 ms (the share's cap needs the host time)
        gpu["done_ms"] = 30.0
        third = prof.close_interval()
    a, b, c = entries([first, second, third], LONG)
    assert a["count"] == 0 and a["gpu"] is None and a["share"] == a["cpu"]["total_seconds"] / first["duration_seconds"]
    assert b["count"] == 0 and b["gpu"] is None and b["cpu"]["total_seconds"] > 0 and b["open_cpu_seconds"] == 0.0
    assert c["count"] == 1 and c["gpu"]["total_seconds"] == pytest.approx(0.030)
    assert c["cpu"]["total_seconds"] == 0.0 and c["cpu"]["max_seconds"] >= 0.005   # whole, counted with its pair
    assert c["share"] == pytest.approx(0.030 / third["duration_seconds"])            # GPU time, where resolved


def test_console_and_report_say_a_span_was_still_open_and_for_how_long(tmp_path):
    out = io.StringIO()
    with make_prof(tmp_path, exporters=[ConsoleExporter(out)]) as prof:
        with profiler.span(LONG):
            time.sleep(0.02)
            first = prof.close_interval()
            time.sleep(0.02)
            second = prof.close_interval()
        with profiler.span("drafter.fwd_bwd"):
            pass
    thread = threading.current_thread().name
    ages_s = []
    for rec in (first, second):
        text = format_interval(rec).splitlines()
        row = next(line for line in text if line.strip().startswith(LONG))
        ages_s.append(rec["open_spans"][0]["spans"][0]["open_seconds"])
        assert row.split()[1] == "0"                                                     # no count yet
        assert row.split()[-1].endswith("%")                                             # nothing past share
        assert f"  open at the interval's end: {LONG} {ages_s[-1]:.3g} s ({thread})" in text   # on its own line
        assert format_interval(rec) in out.getvalue()                                    # what was printed
    assert 0.02 <= ages_s[0] < ages_s[1] and ages_s[1] >= 0.04
    assert second["spans"][LONG]["share"] == 1.0 and "100.0%" in format_interval(second)  # all of its time
    age_s = ages_s[1]
    report = hotspots(tmp_path)
    row = next(r for r in report["spans"]["rows"] if r["span"] == LONG)
    assert row["count"] == 1 and row["open_intervals"] == 2 and row["open_at_end"] is False
    assert row["open_max_seconds"] == age_s and row["open_where"]["interval"] == 1
    assert row["mean_seconds"] == pytest.approx(row["total_seconds"], rel=1e-9)   # one span: whole = pieces
    lines = format_hotspots(report).splitlines()
    note = next(line for line in lines if line.strip().startswith(f"{LONG} (main): at 2 interval end(s)"))
    assert f"longest {age_s:.3g} s (rank 0 interval 1, {thread})" in note


def test_a_span_open_when_the_log_ends_holds_time_but_not_the_mean(tmp_path):
    with make_prof(tmp_path) as prof:
        with profiler.span(LONG):
            time.sleep(0.01)
        prof.close_interval()
        hung = profiler.span(LONG)
        hung.__enter__()                     # still open at the final interval's close
        time.sleep(0.03)
    hung.__exit__(None, None, None)
    log, _ = profiler.read_records(prof.log_path)
    end = [r for r in log if r["type"] == "run_end"][-1]
    whole_s = end["spans"][LONG]["cpu"]["mean_seconds"]
    assert end["spans"][LONG]["count"] == 1 and end["spans"][LONG]["cpu"]["total_seconds"] >= whole_s + 0.03
    rows, _ = hotspot_rows([end])
    assert rows[0][1] == LONG and rows[0][4] == whole_s                      # mean: the one whole span
    report = hotspots(tmp_path)
    row = next(r for r in report["spans"]["rows"] if r["span"] == LONG)
    assert row["mean_seconds"] == pytest.approx(whole_s) and row["total_seconds"] >= whole_s + 0.03
    assert row["open_at_end"] is True and row["open_intervals"] == 1
    assert "; still open when the log ends" in format_hotspots(report)


def test_a_cuda_span_longer_than_the_interval_never_holds_more_than_all_of_it(tmp_path):
    """A first step with compilation: GPU time about its host time, resolved intervals after it began.
    The whole GPU time is in the `gpu` block where it resolved; `share` caps it at the host window it
    can have run in within that interval (module doc of profiler/intervals.py)."""
    gpu = {"now_ms": 0.0, "done_ms": -1.0}
    with make_prof(tmp_path, event_pool=EventPool(lambda: FakeEvent(gpu), prealloc=2)) as prof:
        with profiler.span(LONG):
            time.sleep(0.02)
            first = prof.close_interval()
            time.sleep(0.02)
            gpu["now_ms"] += 45.0                      # GPU busy the whole time the host was in it (and a bit)
        time.sleep(0.005)
        gpu["done_ms"] = 45.0
        second = prof.close_interval()
    a, b = entries([first, second], LONG)
    assert a["count"] == 0 and a["share"] <= 1.0
    assert b["count"] == 1 and b["gpu"]["total_seconds"] == pytest.approx(0.045)
    assert b["share"] <= 1.0 and b["share"] * second["duration_seconds"] <= 0.045


def test_self_time_leaves_out_children_in_every_interval_and_adds_up(tmp_path):
    """A parent open across a boundary, its child crossing the same boundary, and a second child: in each
    interval the parent's self time is its piece less its children's pieces, and parent self plus child
    time is the parent's time (a stack of self times never puts a child on its parent)."""
    parent, child = "drafter.fwd_bwd", LONG
    with make_prof(tmp_path) as prof:
        with profiler.span(parent):
            time.sleep(0.01)
            with profiler.span(child):
                time.sleep(0.02)
                recs = [prof.close_interval()]          # both open at this boundary
                time.sleep(0.02)
            time.sleep(0.01)
            with profiler.span(child):
                time.sleep(0.01)
        recs.append(prof.close_interval())
    log, _ = profiler.read_records(prof.log_path)
    end = [r for r in log if r["type"] == "run_end"][-1]["spans"]
    for rec in recs:
        p, c = rec["spans"][parent]["cpu"], rec["spans"][child]["cpu"]
        assert c["self_seconds"] == c["total_seconds"]   # the child has no children
        assert ns(p["self_seconds"]) + ns(c["total_seconds"]) == ns(p["total_seconds"])
        assert p["self_seconds"] >= 0.009
    p, c = end[parent]["cpu"], end[child]["cpu"]
    assert abs(p["self_seconds"] + c["total_seconds"] - p["total_seconds"]) < 1e-6
    assert 0.019 <= p["self_seconds"] < p["total_seconds"] - 0.04
