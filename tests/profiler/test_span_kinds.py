"""profiler/schema/span_kinds.py, the one reader of a run_start's `span_table`: rows as docs/RUNLOG.md writes them, a
flow said as a kind, what a reader does not know read as work, and FALLBACK for a log written before the table."""
from __future__ import annotations

from profiler.schema.span_kinds import FALLBACK, SpanKind, of_run_start, of_run_starts


def test_rows_read_as_written():
    kinds = of_run_start({"span_table": {
        "a.wait": {"role": "b", "kind": "wait"}, "a.sync": {"role": "a", "kind": "collective"},
        "a.save": {"role": "a", "kind": "phase"}, "a.send": {"role": "a", "kind": "work", "flow": "start"},
        "b.recv": {"role": "b", "kind": "wait", "flow": "end"}, "a.step": {"role": "a", "kind": "work"}}})
    assert kinds.written and kinds.waits() == {"a.wait": "b", "b.recv": "b"}
    assert kinds.is_wait("a.wait", "b") and not kinds.is_wait("a.wait", "a") and not kinds.is_wait("x", "b")
    assert kinds.names("collective") == ("a.sync",) and kinds.names("phase") == ("a.save",)
    assert kinds.flows() == {"a.send": "start", "b.recv": "end"}


def test_a_flow_said_as_a_kind_is_work_with_that_flow_and_the_unknown_is_work():
    kinds = of_run_start({"span_table": {"s": {"role": "t", "kind": "flow_start"}, "e": {"kind": "flow_end"},
                                         "odd": {"role": 3, "kind": "sleeping", "flow": "sideways"}, "bare": None}})
    assert kinds.rows == {"s": SpanKind("t", "work", "start"), "e": SpanKind(None, "work", "end"),
                          "odd": SpanKind(None, "work", None), "bare": SpanKind(None, "work", None)}


def test_a_log_without_the_table_reads_as_the_fallback_and_an_empty_one_as_no_kinds():
    assert of_run_start({}) is FALLBACK and of_run_start(None) is FALLBACK
    assert of_run_start({"span_table": "not a table"}) is FALLBACK
    assert FALLBACK.waits() == {"transfer.wait_slot": "target", "drafter.recv": "drafter"}
    assert FALLBACK.names("collective") == ("drafter.allreduce",)
    assert FALLBACK.flows() == {"transfer.send": "start", "drafter.recv": "end"}
    empty = of_run_start({"span_table": {}})   # a loop of its own: every span its own work
    assert empty.written and empty.waits() == {} and empty.flows() == {}
    assert of_run_starts([{}, {"span_table": {}}]) == empty and of_run_starts([{}, {}]) is FALLBACK
