"""One Perfetto/Chrome trace of every rank of a run, rebuilt from its run logs (so it works after a crash,
when the live per-rank files may be stale): `dflash-report trace RUN_DIR [-o FILE]`. Standard library only."""
from __future__ import annotations

from pathlib import Path

from monitoring.trace_events import MAX_EVENTS, FlowSpans, build_trace, flows_matched, json_safe, newest_within, \
    prepare, proc_info, write_trace
from report.runs import Run, load_run, span_kinds


def merged_trace(run: Run, max_events: int = MAX_EVENTS) -> tuple[list, dict, list]:
    """(traceEvents, counts, procs) of a run loaded with its spans: each rank's newest detail windows within
    its share of max_events (they line up in time); each proc holds its `records` and `evicted` spans."""
    budget = max(1, max_events // len(run.ranks))
    procs = []
    for rank, log in run.ranks.items():
        proc = proc_info(rank, log.run_starts[-1] if log.run_starts else {"role": log.role})
        proc["records"], _, evicted = newest_within(log.spans, budget)
        proc["evicted"] = evicted + log.spans_evicted   # and those let go while the log was read
        procs.append(proc)
    flow_spans = FlowSpans.of(span_kinds(run).flows())
    events, counts = build_trace(procs, [prepare(p["rank"], r, flow_spans) for p in procs for r in p["records"]])
    return events, counts, procs


def flow_counts(run: Run, max_events: int = MAX_EVENTS) -> dict:
    """{"flows_matched", "flow_sends"} of merged_trace(run, max_events), from the same detail windows, without
    building its events (what `check` reads: the trace's half a million slices are not held for two numbers)."""
    budget, flow_spans = max(1, max_events // len(run.ranks)), FlowSpans.of(span_kinds(run).flows())
    flows = [f for rank, log in run.ranks.items() for r in newest_within(log.spans, budget)[0]
             for f in prepare(rank, r, flow_spans)["flows"]]
    return {"flows_matched": flows_matched(flows), "flow_sends": sum(1 for _, is_start, _ in flows if is_start)}


def merge_traces(run_dir, out_path=None, max_events: int = MAX_EVENTS) -> dict:
    """The merged trace of RUN_DIR's run logs, written to out_path (default RUN_DIR/trace/merged.json); returns
    a summary. ReportError for a directory with no run logs."""
    run = load_run(run_dir, with_spans=True, max_events=max_events, with_intervals=False)   # a trace draws no interval
    events, counts, procs = merged_trace(run, max_events)
    out = Path(out_path) if out_path is not None else Path(run_dir) / "trace" / "merged.json"
    summary = {"out": str(out), "ranks": list(run.ranks), **counts,
               "evicted_spans": sum(p["evicted"] for p in procs),
               "profiler_dropped_spans": sum(log.spans_profiler_dropped for log in run.ranks.values()),
               "bad_lines": sum(log.bad_lines for log in run.ranks.values())}
    ranks = {str(p["rank"]): {**{k: v for k, v in p.items() if k not in ("rank", "records", "evicted")},
                              "segments": len(run.ranks[p["rank"]].run_starts),
                              "bad_lines": run.ranks[p["rank"]].bad_lines} for p in procs}
    meta = {"source": "run logs", "run_dir": run.run_dir, "timebase": "Unix microseconds",
            **{k: v for k, v in summary.items() if k not in ("out", "ranks")}, "ranks": ranks}
    write_trace(out, events, json_safe(meta))
    return summary
