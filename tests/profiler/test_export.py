"""The exporter contract and the records exporters read: the exporter thread, a bounded queue, drops
counted, a failing or slow exporter never stalls the training thread; schema-1 fields (clock anchor,
histogram buckets, the detail window's `spans` record with parents, tags and native thread ids)."""
import logging
import threading
import time

import pytest

import profiler
from profiler.export import ExportHub
from profiler.stats import HISTOGRAM_BUCKETS_SECONDS
from tests.profiler.build import make_profiler


class Recording:
    name = "rec"

    def __init__(self, delay_s=0.0):
        self.records, self.threads, self.delay_s, self.closed = [], set(), delay_s, False

    def export(self, record):
        time.sleep(self.delay_s)
        self.threads.add(threading.current_thread().name)
        self.records.append(record)

    def close(self, timeout_s):
        self.closed = True


class Failing:
    name = "bad"

    def export(self, record):
        raise ConnectionError("collector down")

    def close(self, timeout_s):
        pass


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 60.0)
    return make_profiler(tmp_path, control=False, measure_floors=False, **kw)


def test_records_reach_exporters_on_the_exporter_thread_in_order(tmp_path):
    rec = Recording()
    with make_prof(tmp_path, exporters=[rec]) as prof:
        with profiler.span("x.step"):
            pass
        prof.close_interval()
        profiler.event("checkpoint", path="p")
    types = [r["type"] for r in rec.records]
    assert types[0] == "run_start" and types[-1] == "run_end" and "interval" in types and "event" in types
    assert rec.threads == {"profiler.exporter"} and rec.closed


def test_failing_exporter_logs_once_counts_drops_and_others_still_export(tmp_path, caplog):
    good = Recording()
    with caplog.at_level(logging.WARNING, logger="profiler"):
        with make_prof(tmp_path, exporters=[Failing(), good]) as prof:
            for _ in range(3):
                prof.close_interval()
    lines = [r for r in caplog.records if "exporter bad failed" in r.getMessage()]
    assert len(lines) == 1 and "collector down" in lines[0].getMessage()
    kinds = [r["type"] for r in good.records]
    assert kinds[-1] == "run_end" and [k for k in kinds if k != "tick"] == [   # a tick beside every close
        "run_start", "interval", "interval", "interval", "interval", "run_end"]
    final = prof.hub.stats()   # after close: every record went through
    assert final["bad"] == {"exported": 0, "dropped": len(kinds), "failed": True}
    assert final["rec"] == {"exported": len(kinds), "dropped": 0, "failed": False}


def test_slow_exporter_never_blocks_the_training_thread_and_full_queue_drops(tmp_path):
    slow = Recording(delay_s=0.2)
    hub = ExportHub([slow], maxsize=2)
    hub.start()
    t0 = time.perf_counter()
    for i in range(50):
        hub.submit({"type": "event", "i": i})
    assert time.perf_counter() - t0 < 0.05          # submit is a put_nowait
    stats = hub.close(timeout_s=1.0)
    assert stats["rec"]["dropped"] >= 45             # the queue held 2, the exporter took one at a time
    assert stats["rec"]["exported"] == len(slow.records) <= 5


def test_close_respects_its_deadline_with_a_stuck_exporter():
    class Stuck(Recording):
        def export(self, record):
            time.sleep(30)
    hub = ExportHub([Stuck()])
    hub.start()
    hub.submit({"type": "event"})
    t0 = time.monotonic()
    hub.close(timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0


def test_run_start_anchor_buckets_and_detail_window(tmp_path):
    rec = Recording()
    with make_prof(tmp_path, exporters=[rec], detail_steps=2) as prof:
        for step in range(5):
            profiler.set_step(step)
            with profiler.span("x.outer"):
                with profiler.span("x.inner", bytes=100):
                    profiler.tag(flow=f"1:{step}")
                    time.sleep(0.002)
        prof.close_interval()
    start = rec.records[0]
    assert start["schema"] == 1 and start["run_id"] == tmp_path.name
    assert start["histogram_buckets_seconds"] == list(HISTOGRAM_BUCKETS_SECONDS)
    assert abs(start["clock"]["unix_ns"] / 1e9 - start["time_unix"]) < 1.0
    spans = next(r for r in rec.records if r["type"] == "spans")
    assert spans["steps"] == [0, 1] and spans["dropped"] == 0 and len(spans["spans"]) == 4
    outer = [s for s in spans["spans"] if s["name"] == "x.outer"]
    inner = [s for s in spans["spans"] if s["name"] == "x.inner"]
    assert [s["parent"] for s in inner] == [s["id"] for s in outer]
    assert [s["attrs"] for s in inner] == [{"flow": "1:0"}, {"flow": "1:1"}]
    assert all(s["tid"] == threading.get_native_id() and s["thread"] == "MainThread" for s in spans["spans"])
    for s in inner:
        assert s["bytes"] == 100 and s["end_unix_ns"] - s["start_unix_ns"] >= 2e6
        assert abs(s["start_unix_ns"] / 1e9 - time.time()) < 60
    interval = next(r for r in rec.records if r["type"] == "interval")
    cpu = interval["spans"]["x.inner"]["cpu"]
    assert sum(cpu["buckets"]) == 5 and len(cpu["buckets"]) == len(HISTOGRAM_BUCKETS_SECONDS) + 1
    assert cpu["buckets"][HISTOGRAM_BUCKETS_SECONDS.index(0.0025)] + cpu["buckets"][
        HISTOGRAM_BUCKETS_SECONDS.index(0.005)] + sum(cpu["buckets"][HISTOGRAM_BUCKETS_SECONDS.index(0.01):]) == 5
    assert {"name": "MainThread", "native_id": threading.get_native_id()} in interval["threads"]


def test_exporters_run_off_the_calling_thread_and_conform_to_the_protocol(tmp_path):
    from profiler.export import Exporter

    seen = []

    class Probe:
        name = "probe"

        def export(self, record: dict) -> None:
            seen.append((record["type"], threading.current_thread().name))

        def close(self, timeout_s: float) -> None:
            seen.append(("closed", timeout_s))

    assert isinstance(Probe(), Exporter) and not isinstance(object(), Exporter)
    with make_prof(tmp_path, exporters=[Probe()], export_timeout_s=3.0):
        profiler.event("checkpoint")
    assert ("event", "profiler.exporter") in seen and seen[-2][0] == "run_end"
    assert seen[-1][0] == "closed" and 0 < seen[-1][1] <= 3.0


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_metric_is_null_with_a_reason_for_exporters_too(tmp_path, value):
    rec = Recording()
    with make_prof(tmp_path, exporters=[rec]) as prof:
        profiler.metric("loss", value)
        prof.close_interval()
    loss = next(r for r in rec.records if r["type"] == "interval")["metrics"]["loss"]
    assert loss["last"] is None and loss["reasons"]["last"].startswith("non-finite")


def test_detail_window_starts_on_an_aligned_step_once_intervals_are_long_enough():
    from profiler.detail import DetailWindow, StepMarks
    from profiler.spans import SpanRecord

    marks = StepMarks()
    window = DetailWindow(2, marks, lambda t: t, {})
    span = lambda t: SpanRecord.of("x.step", t, t + 1, 0, None, t, None, None)   # noqa: E731
    for step in range(0, 20):          # interval 0: 20 steps, window = its first two (0, 1)
        marks.mark(step * 100, step)
        window.offer([("main", span(step * 100 + 1), None)])
    assert window.take()["steps"] == [0, 1]
    for step in range(20, 40):         # interval 1 starts at step 20: the window waits for step 24
        marks.mark(step * 100, step)
        window.offer([("main", span(step * 100 + 1), None)])
    got = window.take()
    assert got["steps"] == [24, 25] and [s["start_unix_ns"] for s in got["spans"]] == [2401, 2501]
