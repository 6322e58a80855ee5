"""What each span of a run is, read from its run_start `span_table` (docs/RUNLOG.md): the one reader of the table
that the report, its check and compare, and the traces use. A log written before run_start held the table reads as
FALLBACK, the kinds dflash-train's spans had then. Standard library only.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

WORK, WAIT, PHASE, COLLECTIVE = "work", "wait", "phase", "collective"
FLOW_KINDS = {"flow_start": "start", "flow_end": "end"}
"""A row may say its flow end as its kind (a work span that starts or ends a flow arrow) instead of in `flow`."""
KINDS = (WORK, WAIT, PHASE, COLLECTIVE, *FLOW_KINDS)
"""Every kind a span_table row may carry."""
START, END = "start", "end"


@dataclass(frozen=True)
class SpanKind:
    """One row: the role that enters the span, what its time is (WORK, WAIT, PHASE or COLLECTIVE), and where a
    trace joins it to its counterpart with an arrow (START, END or None)."""
    role: str | None
    kind: str = WORK
    flow: str | None = None


@dataclass(frozen=True)
class SpanKinds:
    """A run's span table: the rows by span name (a span not in it is the rank's own work)."""
    rows: Mapping[str, SpanKind]
    written: bool = True
    """Whether the run's run_start held the table (False: FALLBACK, for a log written before it did)."""

    def names(self, kind: str) -> tuple:
        """The spans of one kind, in the table's order."""
        return tuple(name for name, row in self.rows.items() if row.kind == kind)

    def waits(self) -> dict:
        """{span: role} of the spans in which that role waits on another."""
        return {name: row.role for name, row in self.rows.items() if row.kind == WAIT}

    def is_wait(self, name: str, role: str | None) -> bool:
        """Whether `name` is a span in which `role` waits on another."""
        row = self.rows.get(name)
        return row is not None and row.kind == WAIT and row.role == role

    def flows(self) -> dict:
        """{span: START or END} of the spans a trace joins with flow arrows."""
        return {name: row.flow for name, row in self.rows.items() if row.flow is not None}


def _row(raw) -> SpanKind:
    """One run_start row as a SpanKind: a kind this reader does not know reads as work, a flow kind as work with
    that flow."""
    raw = raw if isinstance(raw, Mapping) else {}
    kind, flow = raw.get("kind"), raw.get("flow")
    if kind in FLOW_KINDS:
        kind, flow = WORK, flow or FLOW_KINDS[kind]
    role = raw.get("role")
    return SpanKind(role=role if isinstance(role, str) else None, kind=kind if kind in KINDS else WORK,
                    flow=flow if flow in (START, END) else None)


FALLBACK = SpanKinds({
    "transfer.wait_slot": SpanKind("target", WAIT),
    "transfer.send": SpanKind("target", WORK, START),
    "drafter.recv": SpanKind("drafter", WAIT, END),
    "drafter.allreduce": SpanKind("drafter", COLLECTIVE),
    "drafter.compile": SpanKind("drafter", PHASE),
    "triton.autotune": SpanKind("drafter", PHASE),
    "eval.decode": SpanKind("drafter", PHASE),
    "ckpt.save": SpanKind("drafter", PHASE),
}, written=False)
"""The kinds of a log whose run_start has no span_table: dflash-train's waits, collective, flow and phases when
they were constants of the readers."""


def of_run_start(start: Mapping | None) -> SpanKinds:
    """The span table of one run_start record; FALLBACK when it has none (a log written before it did)."""
    table = (start or {}).get("span_table")
    if not isinstance(table, Mapping):
        return FALLBACK
    return SpanKinds({str(name): _row(raw) for name, raw in table.items()})


def of_run_starts(starts) -> SpanKinds:
    """The span table of a run's ranks: the first run_start that holds one (every rank of a run writes the same);
    FALLBACK when none does."""
    return next((of_run_start(s) for s in starts if isinstance((s or {}).get("span_table"), Mapping)), FALLBACK)
