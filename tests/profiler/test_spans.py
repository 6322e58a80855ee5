"""Spans: nesting per thread, thread names, no lost/double-counted records under concurrent drains,
name validation, the no-op path and the decorator."""
import threading

import pytest

import profiler
from profiler import api
from tests.profiler.build import make_profiler


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)
    return make_profiler(tmp_path, measure_floors=False, control=False, background=False, **kw)


def test_nesting_depths_and_thread_names_in_three_threads(tmp_path):
    n = 50
    with make_prof(tmp_path) as prof:
        def work():
            for _ in range(n):
                with profiler.span("t.outer"):
                    with profiler.span("t.mid"):
                        with profiler.span("t.inner"):
                            pass
        threads = [threading.Thread(target=work, name=f"role{i}.main") for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        drained = prof.recorder.drain()
    by_thread = {name: spans for name, spans, _ in drained}
    assert sorted(by_thread) == ["role0.main", "role1.main", "role2.main"]
    for spans in by_thread.values():
        assert len(spans) == 3 * n
        depth = {}
        for s in spans:
            depth.setdefault(s.name, set()).add(s.depth)
            assert s.t1_ns >= s.t0_ns and s.bytes is None
        assert depth == {"t.outer": {0}, "t.mid": {1}, "t.inner": {2}}
        # inner ends first, then mid, then outer; outer encloses inner in time
        names = [s.name for s in spans[:3]]
        assert names == ["t.inner", "t.mid", "t.outer"]
        assert spans[2].t0_ns <= spans[0].t0_ns and spans[0].t1_ns <= spans[2].t1_ns


def test_interval_reports_threads_and_counts(tmp_path):
    with make_prof(tmp_path) as prof:
        def work():
            for _ in range(7):
                with profiler.span("x.step"):
                    pass
        ts = [threading.Thread(target=work, name=f"w{i}") for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rec = prof.close_interval()
    assert rec["spans"]["x.step"]["count"] == 21
    assert rec["spans"]["x.step"]["threads"] == ["w0", "w1", "w2"]


def test_concurrent_appends_while_intervals_close_preserve_exact_count(tmp_path):
    per_thread, n_threads = 3000, 4
    with make_prof(tmp_path) as prof:
        start = threading.Barrier(n_threads + 1)

        def work():
            start.wait()
            for i in range(per_thread):
                with profiler.span("c.outer"):
                    with profiler.span("c.inner"):
                        pass
                profiler.count("items", 1)
        ts = [threading.Thread(target=work, name=f"w{i}") for i in range(n_threads)]
        for t in ts:
            t.start()
        start.wait()
        records = []
        while any(t.is_alive() for t in ts):
            records.append(prof.close_interval())
            prof.tick()          # a poll between closes too
        for t in ts:
            t.join()
    total = n_threads * per_thread
    # the final interval is written by __exit__: read everything back from the run log
    log, bad = profiler.read_records(prof.log_path)
    intervals = [r for r in log if r["type"] == "interval"]
    assert len(intervals) >= 2 and bad == 0
    assert sum(r["spans"].get("c.outer", {}).get("count", 0) for r in intervals) == total
    assert sum(r["spans"].get("c.inner", {}).get("count", 0) for r in intervals) == total
    assert sum(r["counters"].get("items", {}).get("total", 0) for r in intervals) == total
    end = [r for r in log if r["type"] == "run_end"][0]
    assert end["spans"]["c.outer"]["count"] == total
    assert end["counters"]["items"]["total"] == total


@pytest.mark.parametrize("bad", ["Target.fwd", "target..fwd", "", "target fwd", ".x", "x.", "a-b", 3, None, ["x"]])
def test_bad_span_name_raises_with_and_without_profiler(tmp_path, bad):
    with pytest.raises(ValueError, match="bad span name"):
        profiler.span(bad)
    with make_prof(tmp_path):
        with profiler.span("x.ok", bytes=8):   # a good name validated first: the bad one is still checked
            pass
        for _ in range(2):                     # and every time, not once
            with pytest.raises(ValueError, match="bad span name"):
                profiler.span(bad)
            with pytest.raises(ValueError, match="bad span name"):
                profiler.span(bad, bytes=8)


def test_bad_bytes_and_counter_names_raise(tmp_path):
    with pytest.raises(ValueError, match="bytes"):
        profiler.span("d2h_copy", bytes=-1)
    with pytest.raises(ValueError, match="bad counter name"):
        profiler.count("Tokens", 1)
    with make_prof(tmp_path):
        with pytest.raises(ValueError, match="bytes"):
            profiler.span("d2h_copy", bytes=1.5)
        with pytest.raises(ValueError, match=">= 0"):
            profiler.count("tokens", -1)


def test_no_profiler_is_a_shared_noop():
    assert profiler.active() is None
    a, b = profiler.span("target.fwd"), profiler.span("target.fwd")
    assert a is b
    with a:
        pass
    with pytest.raises(KeyError):       # the no-op exit must not swallow exceptions
        with profiler.span("target.fwd"):
            raise KeyError("x")
    assert not a.__exit__(KeyError, KeyError("x"), None)
    # counters etc. are no-ops, corrupt is identity
    profiler.count("tokens", 5)
    profiler.gauge("queue_depth", 1)
    profiler.metric("loss", 1.0)
    profiler.set_step(3)
    profiler.event("checkpoint")
    obj = object()
    assert profiler.corrupt("target.fwd", obj) is obj


def test_decorator_applied_before_profiler_times_later_calls(tmp_path):
    @profiler.span("drafter.optim")
    def step(x):
        return x + 1

    assert step(1) == 2          # no profiler: plain call
    with make_prof(tmp_path) as prof:
        assert step(2) == 3 and step(3) == 4
        rec = prof.close_interval()
    assert rec["spans"]["drafter.optim"]["count"] == 2
    assert step.__name__ == "step"


def test_span_records_even_when_block_raises(tmp_path):
    with make_prof(tmp_path) as prof:
        with pytest.raises(KeyError):
            with profiler.span("x.fail"):
                raise KeyError("boom")
        with profiler.span("x.after"):
            pass
        drained = prof.recorder.drain()
    spans = drained[0][1]
    assert [(s.name, s.depth) for s in spans] == [("x.fail", 0), ("x.after", 0)]


def test_open_spans_visible_from_another_thread(tmp_path):
    inside, release = threading.Event(), threading.Event()
    with make_prof(tmp_path) as prof:
        def work():
            with profiler.span("target.fwd"):
                with profiler.span("target.pack_hidden"):
                    inside.set()
                    release.wait(5)
        t = threading.Thread(target=work, name="target.main")
        t.start()
        assert inside.wait(5)
        state = prof.state()
        release.set()
        t.join()
    [entry] = [e for e in state["active_spans"] if e["thread"] == "target.main"]
    assert [s["name"] for s in entry["spans"]] == ["target.fwd", "target.pack_hidden"]
    assert [s["depth"] for s in entry["spans"]] == [0, 1]
    assert all(s["open_seconds"] >= 0 for s in entry["spans"])
    assert entry["spans"][0]["open_seconds"] >= entry["spans"][1]["open_seconds"]


def test_module_state_cleared_after_exit(tmp_path):
    with make_prof(tmp_path):
        assert isinstance(api._spans, object) and profiler.active() is not None
    assert profiler.active() is None and api._spans is api._noop_view


def test_a_begin_split_by_a_drain_between_its_tag_and_its_time_is_still_one_span():
    """A CPU begin is two log items (tag, then t0): a drain may land between them."""
    from profiler.spans import SpanRecorder

    rec = SpanRecorder()
    st = rec.thread_state()
    st.buf.append(("target.pack_hidden", 64))      # the enter's first append ...
    assert rec.drain() == []
    st.buf.extend([1_000, "target.fwd", 1_500, 2_000, 3_000])   # ... its t0, a nested span, both ends
    (_, spans, _), = rec.drain()
    assert [(s.name, s.t0_ns, s.t1_ns, s.depth, s.bytes, s.id) for s in spans] == [
        ("target.fwd", 1_500, 2_000, 1, None, 1), ("target.pack_hidden", 1_000, 3_000, 0, 64, 0)]
    assert rec.unmatched == 0


def test_a_cpu_span_enters_without_a_python_frame_and_logs_what_the_python_enter_did(tmp_path):
    """The cached CPU span's __enter__ is C calls only (profiler.spans.fast_enter_class): a profile hook
    sees one Python call per span, its __exit__; the log holds the tag and then t0, as
    CpuSpan.__enter__ writes them. A span with bytes= keeps the Python enter (its class is not made
    per call)."""
    import sys
    import time

    from profiler.spans import CpuSpan

    with make_prof(tmp_path) as prof:
        s = profiler.span("target.fwd")
        with s:   # warm: the first use of a name makes its span
            pass
        prof.recorder.drain()
        calls = []
        sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
        try:
            t0 = time.perf_counter_ns()
            with s:
                pass
            t1 = time.perf_counter_ns()
        finally:
            sys.setprofile(None)
        log = list(s._buf)
        b = profiler.span("target.pack_hidden", bytes=8)
        drained = prof.recorder.drain()
    assert calls == ["__exit__"]
    assert log[0] == "target.fwd" and t0 <= log[1] <= log[2] <= t1 and len(log) == 3
    assert type(s).__enter__ is not CpuSpan.__enter__ and type(b) is CpuSpan
    assert [r.name for r in drained[0][1]] == ["target.fwd"]
