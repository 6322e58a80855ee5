"""One Perfetto/Chrome trace of every rank of a run, rebuilt from its run logs (so it works after a crash,
when the live per-rank files may be stale): `dflash-report trace RUN_DIR [-o FILE]`. Standard library only."""
from __future__ import annotations

from pathlib import Path

from profiler.schema.trace_events import MAX_EVENTS, FlowSpans, build_trace, flows_matched, json_safe, newest_within, \
    prepare, proc_info, write_trace
from profiler.report.background import Background, cores
from profiler.report.runs import Run, line_counts, load_run, paused_gc, rank_paths, span_kinds
from profiler.schema.windows import detail_spans, flow_halves


def merged_trace(run: Run, max_events: int = MAX_EVENTS) -> tuple[list, dict, list]:
    """(traceEvents, counts, procs) of a run loaded with its spans: each rank's newest detail windows within
    its share of max_events (they line up in time); each proc holds its `records` and `evicted` spans."""
    events, counts, procs = _drawn(run, max_events)
    _add_evicted(run, procs)
    return events, counts, procs


def _drawn(run: Run, max_events: int) -> tuple[list, dict, list]:
    """merged_trace's (traceEvents, counts, procs), each proc's `evicted` only the spans its trace leaves out of
    the detail windows loaded (_add_evicted adds those let go while the log was read)."""
    budget = max(1, max_events // len(run.ranks))
    procs = []
    for rank, log in run.ranks.items():
        proc = proc_info(rank, log.run_starts[-1] if log.run_starts else {"role": log.role})
        proc["records"], _, proc["evicted"] = newest_within(log.spans, budget)
        procs.append(proc)
    flow_spans = FlowSpans.of(span_kinds(run).flows())
    events, counts = build_trace(procs, [prepare(p["rank"], r, flow_spans) for p in procs for r in p["records"]])
    return events, counts, procs


def _add_evicted(run: Run, procs: list) -> None:
    for p in procs:
        p["evicted"] += run.ranks[p["rank"]].spans_evicted   # and those let go while the log was read


def _flow_prepared(run: Run, max_events: int) -> tuple[list, list]:
    """(procs, prepare() of each drawn detail window cut to its flow halves): merged_trace's windows (the newest
    within each rank's share, chosen over all their spans), holding only what build_trace joins flows from."""
    budget, flow_spans = max(1, max_events // len(run.ranks)), FlowSpans.of(span_kinds(run).flows())
    ends = flow_spans.start | flow_spans.end
    procs, prepared = [], []
    for rank, log in run.ranks.items():
        procs.append(proc_info(rank, log.run_starts[-1] if log.run_starts else {"role": log.role}))
        prepared += [prepare(rank, {**r, "spans": [e for e, name, _ in flow_halves(detail_spans(r))
                                                   if str(name or "span") in ends]}, flow_spans)
                     for r in newest_within(log.spans, budget)[0]]
    return procs, prepared


def flow_trace(run: Run, max_events: int = MAX_EVENTS) -> tuple[list, dict]:
    """(traceEvents, counts) of merged_trace(run, max_events)'s flow halves alone: its flow points (ids, times)
    and flow counts are the merged trace's, without its half a million other slices laid out (what `check`
    reads)."""
    return build_trace(*_flow_prepared(run, max_events))


def flow_counts(run: Run, max_events: int = MAX_EVENTS) -> dict:
    """{"flows_matched", "flow_sends"} of merged_trace(run, max_events), from the same detail windows, without
    building its events."""
    flows = [f for prep in _flow_prepared(run, max_events)[1] for f in prep["flows"]]
    return {"flows_matched": flows_matched(flows), "flow_sends": sum(1 for _, is_start, _ in flows if is_start)}


def merge_traces(run_dir, out_path=None, max_events: int = MAX_EVENTS) -> dict:
    """The merged trace of RUN_DIR's run logs, written to out_path (default RUN_DIR/trace/merged.json); returns
    a summary. ReportError for a directory with no run logs. With two cores, a child process counts what the
    older detail windows hold (their spans, the profiler's dropped ones, bad lines) while this one reads only the
    windows it draws and lays them out; with one, the load counts them."""
    with paused_gc():   # the detail windows and the slices: millions of objects the collector need not walk
        return _merged_written(run_dir, out_path, max_events)


def _merged_written(run_dir, out_path, max_events: int) -> dict:
    if cores() < 2:
        run = load_run(run_dir, with_spans=True, max_events=max_events, with_intervals=False)
        return _write(run, out_path, *merged_trace(run, max_events))
    logs = rank_paths(run_dir)[0]
    with Background(line_counts, logs, max_events, False) as counting:
        run = load_run(run_dir, with_spans=True, max_events=max_events, with_intervals=False, read_older=False,
                       second_core=False)   # the counting child has the second core
        events, counts, procs = _drawn(run, max_events)
        for rank, (bad, examples, evicted, dropped) in counting.result().items():
            log = run.ranks[rank]
            log.bad_lines, log.bad_examples, log.spans_evicted, log.spans_profiler_dropped = bad, examples, evicted, \
                dropped
    _add_evicted(run, procs)
    return _write(run, out_path, events, counts, procs)


def _write(run: Run, out_path, events: list, counts: dict, procs: list) -> dict:
    """Write the merged trace beside its metadata (default RUN_DIR/trace/merged.json); its summary."""
    out = Path(out_path) if out_path is not None else Path(run.run_dir) / "trace" / "merged.json"
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
