"""One Perfetto/Chrome trace of every rank of a run, rebuilt from its run logs (so it works after a crash,
when the live per-rank files may be stale): `dflash-report trace RUN_DIR [-o FILE]`. Standard library only."""
from __future__ import annotations

from pathlib import Path

from monitoring.trace_events import MAX_EVENTS, build_trace, json_safe, newest_within, num, prepare, proc_info, \
    write_trace
from report.runs import load_run


def merge_traces(run_dir, out_path=None, max_events: int = MAX_EVENTS) -> dict:
    """The merged trace of RUN_DIR's run logs, written to out_path (default RUN_DIR/trace/merged.json); returns
    a summary. ReportError for a directory with no run logs."""
    run = load_run(run_dir, with_spans=True)
    budget = max(1, max_events // len(run.ranks))      # newest windows of every rank, which line up in time
    procs, ranks, evicted, prof_dropped = [], {}, 0, 0
    for rank, log in run.ranks.items():
        proc = proc_info(rank, log.run_starts[-1] if log.run_starts else {"role": log.role})
        proc["records"], _, n_evicted = newest_within(log.spans, budget)
        proc["segments"] = len(log.run_starts)
        procs.append(proc)
        evicted += n_evicted
        prof_dropped += sum(int(num(r.get("dropped")) or 0) for r in log.spans)
        ranks[str(rank)] = {**{k: v for k, v in proc.items() if k not in ("rank", "records")},
                            "bad_lines": log.bad_lines}
    events, counts = build_trace(procs, [prepare(p["rank"], r) for p in procs for r in p["records"]])
    out = Path(out_path) if out_path is not None else Path(run_dir) / "trace" / "merged.json"
    summary = {"out": str(out), "ranks": list(run.ranks), **counts, "evicted_spans": evicted,
               "profiler_dropped_spans": prof_dropped, "bad_lines": sum(log.bad_lines for log in run.ranks.values())}
    meta = {"source": "run logs", "run_dir": run.run_dir, "timebase": "Unix microseconds",
            **{k: v for k, v in summary.items() if k not in ("out", "ranks")}, "ranks": ranks}
    write_trace(out, events, json_safe(meta))
    return summary
