"""dflash/pipeline.py, the one table of the pipeline's spans: what its readers get from it, that a log's run_start
table reads back as the kinds older logs are read with, and the journey of a new wait span, one row, end to end:
the trainer's fault points and dflash-profile's waits, the run_start the profiler writes, the report that reads it,
and the generated rules."""
from __future__ import annotations

import time

import pytest

import profiler
from profiler import report
from dflash import pipeline
from exporters import rules
from profiler.faults import check_injection_points, parse_faults
from profiler.schema.span_kinds import FALLBACK, of_run_start
from tests.profiler.build import make_profiler


def test_the_table_gives_each_reader_its_spans():
    assert pipeline.phase_spans() == ("drafter.compile", "triton.autotune", "eval.decode", "ckpt.save")
    assert pipeline.wait_spans() == {"transfer.wait_slot": "target", "drafter.recv": "drafter"}
    assert pipeline.waits_for_role() == {"transfer.wait_slot": "drafter", "transfer.send": "drafter",
                                         "drafter.recv": "target", "drafter.allreduce": "drafter"}
    assert pipeline.nan_fault_spans() == ("target.pack_hidden", "transfer.send", "drafter.fwd_bwd")
    assert set(pipeline.fault_spans()) == {s.name for s in pipeline.SPANS} - {"drafter.compile", "triton.autotune"}
    assert pipeline.span_table()["drafter.recv"] == {"role": "drafter", "kind": "wait", "flow": "end"}
    with pytest.raises(ValueError, match="span x.y: unknown kind 'idle'"):
        pipeline.Span("x.y", pipeline.DRAFTER, "idle")


def test_the_run_start_table_reads_back_with_every_kind_older_logs_are_read_with():
    """An older log (no span_table) is read with FALLBACK: the run_start table of today's pipeline holds each of
    its rows as it is."""
    kinds = of_run_start({"span_table": pipeline.span_table()})
    assert kinds.written and not FALLBACK.written
    assert FALLBACK.rows.items() <= kinds.rows.items()
    assert kinds.flows() == {"transfer.send": "start", "drafter.recv": "end"}
    assert of_run_start({"phase_spans": []}) is FALLBACK


NEW = pipeline.Span("drafter.wait_rng", pipeline.DRAFTER, pipeline.WAIT, waits_for=pipeline.TARGET)
"""A wait span the pipeline does not have: the drafter waiting on its targets' random state."""


@pytest.fixture
def new_wait(monkeypatch):
    """The pipeline with NEW added: its one row."""
    monkeypatch.setattr(pipeline, "SPANS", (*pipeline.SPANS, NEW))


def test_a_new_wait_span_is_one_row_end_to_end(new_wait, tmp_path):
    # the trainer: a fault may name it, dflash-profile explains a rank stuck in it
    check_injection_points(parse_faults(f"slow=0.1@{NEW.name}"), pipeline.fault_spans(), pipeline.nan_fault_spans())
    assert pipeline.waits_for_role()[NEW.name] == "target"
    # the profiler writes the table into run_start as dflash/worker.py gives it
    with make_profiler(tmp_path, role="drafter", interval_s=3600.0, control=False, measure_floors=False,
                       span_table=pipeline.span_table(), phase_spans=pipeline.phase_spans()):
        for step in range(3):
            profiler.set_step(step)
            with profiler.span("drafter.recv"):
                time.sleep(0.002)
            with profiler.span(NEW.name):
                time.sleep(0.002)
            with profiler.span("drafter.fwd_bwd"):
                time.sleep(0.004)
    (start, *_), _ = profiler.read_records(tmp_path / "profile" / "rank0.jsonl")
    assert start["span_table"][NEW.name] == {"role": "drafter", "kind": "wait"}
    # the report reads it from the log: a wait of the drafter beside drafter.recv
    rep = report.hotspots(tmp_path)
    assert rep["verdict"]["roles"]["drafter"]["wait_span"] == f"drafter.recv, {NEW.name}"
    assert {r["span"] for r in rep["spans"]["rows"] if r["wait"]} == {"drafter.recv", NEW.name}
    # the generated rules count its time as the drafter's wait
    (wait_rule, *_) = rules.records(rules.Scale(), pipeline.wait_spans())
    assert f'role="drafter", span="{NEW.name}"' in wait_rule.expr
