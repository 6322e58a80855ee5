"""One Perfetto/Chrome trace of every rank of a run, rebuilt from its run logs (so it works after a crash,
when the live per-rank files may be stale): `dflash-report trace RUN_DIR [-o FILE]`. Standard library only."""
from __future__ import annotations

from pathlib import Path

from monitoring.trace_events import MAX_EVENTS, build_trace, json_safe, newest_within, num, prepare, proc_info, \
    write_trace
from profiler.records import RUN_START, SPANS, check_schema, of_type, read_run_dir
from report.runs import ReportError


def _read_logs(run_dir: Path) -> dict:
    """{rank: (records, n_bad)}, or ReportError naming what is wrong with run_dir."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such directory")
    try:
        logs = read_run_dir(run_dir)
    except OSError as exc:
        raise ReportError(f"{run_dir}: cannot read its run logs: {exc}") from None
    if not logs:
        raise ReportError(f"{run_dir}: not a run directory (no profile/rank*.jsonl)")
    if not any(records for records, _ in logs.values()):
        raise ReportError(f"{run_dir}: its run logs hold no records")
    return logs


def _rank_proc(rank: int, records: list, budget: int) -> tuple[dict, int, int]:
    """A rank's process description with its newest spans records -> (proc, evicted, profiler drops)."""
    starts = of_type(records, RUN_START)
    for rs in starts:
        try:
            check_schema(rs, f"rank {rank} log")
        except ValueError as exc:
            raise ReportError(str(exc)) from None
    proc = proc_info(rank, starts[-1] if starts else next((r for r in records if r.get("role")), {}))
    spans = of_type(records, SPANS)
    proc["records"], _, evicted = newest_within(spans, budget)
    proc["segments"] = len(starts)
    return proc, evicted, sum(int(num(r.get("dropped")) or 0) for r in spans)


def merge_traces(run_dir, out_path=None, max_events: int = MAX_EVENTS) -> dict:
    """One trace for every rank of a run, built from RUN_DIR/profile/rank*.jsonl (so it also works after
    a crash, when per-rank trace files may be stale) and written to out_path (default
    RUN_DIR/trace/merged.json). Returns a summary; ReportError for a directory with no run logs."""
    run_dir = Path(run_dir)
    logs = _read_logs(run_dir)
    budget = max(1, max_events // len(logs))      # newest windows of every rank, which line up in time
    procs, ranks, evicted, prof_dropped = [], {}, 0, 0
    for rank, (records, bad) in logs.items():
        proc, ev, dropped = _rank_proc(rank, records, budget)
        procs.append(proc)
        evicted, prof_dropped = evicted + ev, prof_dropped + dropped
        ranks[str(rank)] = {**{k: v for k, v in proc.items() if k not in ("rank", "records")}, "bad_lines": bad}
    events, counts = build_trace(procs, [prepare(p["rank"], r) for p in procs for r in p["records"]])
    out = Path(out_path) if out_path is not None else run_dir / "trace" / "merged.json"
    summary = {"out": str(out), "ranks": list(logs), **counts, "evicted_spans": evicted,
               "profiler_dropped_spans": prof_dropped,
               "bad_lines": sum(bad for _, bad in logs.values())}
    meta = {"source": "run logs", "run_dir": str(run_dir), "timebase": "Unix microseconds",
            **{k: v for k, v in summary.items() if k not in ("out", "ranks")}, "ranks": ranks}
    write_trace(out, events, json_safe(meta))
    return summary
