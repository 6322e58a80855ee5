"""The pipeline's spans, one row each (DESIGN.md "Span names"): which role enters it, what its time is, where it
joins a flow arrow, which role a rank stuck in it waits on, which DFLASH_FAULT kinds can fire there, and the
topology it needs to be entered at all. Everything else that names spans by kind reads this table: the loops'
fault points (dflash/preflight.py), the profiler's phases and the run_start `span_table` (dflash/worker.py), which
the report, the traces and the live sinks read back (profiler/schema/span_kinds.py), `dflash-profile snapshot`'s waits
(dflash/profile_cli.py) and the dashboard and rule files (dflash/grafana.py).

A new span is one row here plus its `profiler.span(...)` call. Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass

from profiler.faults import KINDS as FAULT_KINDS
from profiler.schema.span_kinds import COLLECTIVE, END, PHASE, START, WAIT, WORK

TARGET, DRAFTER = "target", "drafter"
ENTRY_FAULTS = tuple(k for k in FAULT_KINDS if k not in ("nan", "drift"))
"""The fault kinds that fire on a span's entry (profiler/faults.py)."""
NAN_FAULTS = ENTRY_FAULTS + ("nan",)
"""... and nan, for a span that hands its output to `profiler.corrupt()`."""
DRIFT_FAULTS = NAN_FAULTS + ("drift",)
"""... and drift, for a span whose corrupt() hook scales a tensor the numerics statistics watch (the target's pack;
in the drafter, the first layer's output)."""

HOST_COPIES, SEVERAL_DRAFTERS, EVAL_PROMPTS = "host copies", "several drafters", "eval prompts"
NEEDS = {HOST_COPIES: "the host-staged transfer path (a GPU run whose transfers are not NCCL's)",
         SEVERAL_DRAFTERS: "more than one drafter rank",
         EVAL_PROMPTS: "held-out prompts to evaluate (--eval-prompts > 0)"}
"""The topologies a span may need to be entered; dflash/preflight.py says which one a run lacks."""


@dataclass(frozen=True)
class Span:
    """One span of the pipeline: each question a reader asks about it is one field."""
    name: str
    role: str
    """The role whose ranks enter it."""
    kind: str = WORK
    """What its time is: WORK, the rank's own; WAIT, waiting on ranks of the other role; PHASE (compile,
    evaluation, checkpoint), which steady-state figures leave out; COLLECTIVE, lock-step with peers of its role."""
    flow: str | None = None
    """START or END where a trace joins it to its counterpart with an arrow (the spans tagged with the same
    `flow`)."""
    waits_for: str | None = None
    """The role whose ranks a rank stuck in it waits on (dflash-profile snapshot's explanation)."""
    faults: tuple = ENTRY_FAULTS
    """The DFLASH_FAULT kinds that can fire here (profiler/faults.py KINDS)."""
    needs: str | None = None
    """The topology (a key of NEEDS) without which a run never enters it; None: every run does."""

    def __post_init__(self):
        known = {"kind": self.kind in (WORK, WAIT, PHASE, COLLECTIVE), "flow": self.flow in (None, START, END),
                 "faults": set(self.faults) <= set(FAULT_KINDS), "needs": self.needs in (None, *NEEDS)}
        bad = [f"{field} {getattr(self, field)!r}" for field, ok in known.items() if not ok]
        if bad:
            raise ValueError(f"span {self.name}: unknown {', '.join(bad)}")


SPANS = (
    Span("target.fetch", TARGET),
    Span("target.fwd", TARGET),
    Span("target.pack_hidden", TARGET, faults=DRIFT_FAULTS),
    Span("d2h_copy", TARGET, needs=HOST_COPIES),
    Span("transfer.wait_slot", TARGET, WAIT, waits_for=DRAFTER),
    Span("transfer.send", TARGET, flow=START, waits_for=DRAFTER, faults=NAN_FAULTS),
    Span("drafter.recv", DRAFTER, WAIT, flow=END, waits_for=TARGET),
    Span("h2d_copy", DRAFTER, needs=HOST_COPIES),
    Span("drafter.unpack", DRAFTER),
    Span("drafter.fwd_bwd", DRAFTER, faults=DRIFT_FAULTS),
    Span("drafter.allreduce", DRAFTER, COLLECTIVE, waits_for=DRAFTER, needs=SEVERAL_DRAFTERS),
    Span("drafter.optim", DRAFTER),
    Span("drafter.compile", DRAFTER, PHASE, faults=()),
    Span("triton.autotune", DRAFTER, PHASE, faults=()),
    Span("eval.decode", DRAFTER, PHASE, needs=EVAL_PROMPTS),
    Span("ckpt.save", DRAFTER, PHASE),
)
"""Every span the pipeline enters, in the order a batch meets them, then the phases."""


def name(span: str) -> str:
    """`span`, checked to be a row of the table (a KeyError where code names a span that is gone)."""
    if span not in {s.name for s in SPANS}:
        raise KeyError(f"{span!r} is not a span of dflash/pipeline.py")
    return span


def named(kind: str) -> tuple:
    """The names of the spans of one kind, in the table's order."""
    return tuple(s.name for s in SPANS if s.kind == kind)


def phase_spans() -> tuple:
    """The spans whose time is a phase (ProfilerConfig.phase_spans, run_start `phase_spans`)."""
    return named(PHASE)


def wait_spans() -> dict:
    """{span: role} of the spans in which a role waits on the other side (the dashboard's and rules' waits)."""
    return {s.name: s.role for s in SPANS if s.kind == WAIT}


def waits_for_role() -> dict:
    """{span: role} of the spans in which a rank waits on ranks of that role (dflash-profile snapshot)."""
    return {s.name: s.waits_for for s in SPANS if s.waits_for is not None}


def fault_spans() -> tuple:
    """The spans where an entry fault (crash, oom, hang, slow) can fire."""
    return tuple(s.name for s in SPANS if set(s.faults) & set(ENTRY_FAULTS))


def nan_fault_spans() -> tuple:
    """The spans with a `profiler.corrupt()` hook, where a nan fault can fire."""
    return tuple(s.name for s in SPANS if "nan" in s.faults)


def drift_fault_spans() -> tuple:
    """The spans with a drift point (a `profiler.corrupt()` hook that fires drift faults)."""
    return tuple(s.name for s in SPANS if "drift" in s.faults)


def span_table() -> dict:
    """The table as plain data for the profiler (ProfilerConfig.span_table, run_start `span_table`, docs/RUNLOG.md):
    {span: {"role", "kind"[, "flow"]}}."""
    return {s.name: {"role": s.role, "kind": s.kind, **({"flow": s.flow} if s.flow else {})} for s in SPANS}


MEMORY_SIZES = {
    "target_tokens": {"role": "target", "scales": {"--tokens-per-batch": 1},
                      "what": "the target's padded batch: rows x the longest row, tokens"},
    "target_attention_cells": {"role": "target", "scales": {"--tokens-per-batch": 1, "--max-length": 1},
                               "what": "the target's attention score cells per head: rows x the longest row squared"},
    "drafter_tokens": {"role": "drafter", "scales": {"--tokens-per-batch": 1},
                       "what": "the drafter's context: the packed batch's tokens"},
    "block_rows": {"role": "drafter", "scales": {"--num-anchors": 1, "--tokens-per-batch": 1},
                   "what": "the drafter's draft blocks' rows: anchors x block size"},
    "drafter_score_cells": {"role": "drafter", "scales": {"--tokens-per-batch": 2, "--num-anchors": 2},
                            "what": "dense attention only: the block rows x (context + block rows) cells of its "
                                    "mask and each head's scores"},
}
"""The sizes the loops name per step (`profiler.memory_sizes`, dflash/loops.py) and how each grows with the settings
that scale it: the memory forecast's "largest --tokens-per-batch / --max-length / --num-anchors that fits"
(ProfilerConfig.memory_sizes, run_start `memory_sizes`). A batch holds at most --tokens-per-batch padded tokens
(rows x longest), so at a fixed batch a longer --max-length means fewer, longer rows: the target's score cells
(rows x longest^2 = tokens x longest, what an attention that keeps its scores holds; a flash kernel's fit gives them
~0 bytes) grow linearly with it, its tokens do not. More tokens a batch means more documents, so more anchors
(--num-anchors is per document): the draft blocks' rows grow with both. Flex attention's memory grows linearly with
the tokens (no score matrix); dense attention holds a [block rows, context + block rows] mask and scores, named
as drafter_score_cells only under it: both of its factors grow with the batch (power 2), and with the anchors its
block part does (power 2, an upper bound on the context part's linear growth)."""
MEMORY_CAPS = {"--max-length": "--tokens-per-batch"}
"""A setting no forecast may take past another's value: a row longer than a batch does not fit in one
(dflash/config.py refuses --max-length above --tokens-per-batch)."""


def memory_sizes() -> dict:
    """MEMORY_SIZES as plain data for the profiler (ProfilerConfig.memory_sizes)."""
    return {name: dict(entry, scales=dict(entry["scales"])) for name, entry in MEMORY_SIZES.items()}


def memory_caps() -> dict:
    """MEMORY_CAPS as plain data for the profiler (ProfilerConfig.memory_caps)."""
    return dict(MEMORY_CAPS)
