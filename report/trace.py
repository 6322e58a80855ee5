"""One Perfetto/Chrome trace of every rank of a run, rebuilt from its run logs (so it works after a crash,
when the live per-rank files may be stale): `dflash-report trace RUN_DIR [-o FILE]`. Standard library only."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from monitoring.trace_events import MAX_EVENTS, build_trace, json_safe, newest_within, num, prepare, proc_info, \
    write_trace
from profiler.records import RUN_START, SPANS, check_schema, of_type, read_run_dir

PROG = "python -m report.trace"


class TraceInputError(ValueError):
    """A run directory a trace cannot be built from (missing, foreign, empty, newer schema)."""


def _read_logs(run_dir: Path) -> dict:
    """{rank: (records, n_bad)}, or TraceInputError naming what is wrong with run_dir."""
    if not run_dir.is_dir():
        raise TraceInputError(f"{run_dir}: no such directory")
    try:
        logs = read_run_dir(run_dir)
    except OSError as exc:
        raise TraceInputError(f"{run_dir}: cannot read its run logs: {exc}") from None
    if not logs:
        raise TraceInputError(f"{run_dir}: not a run directory (no profile/rank*.jsonl)")
    if not any(records for records, _ in logs.values()):
        raise TraceInputError(f"{run_dir}: its run logs hold no records")
    return logs


def _rank_proc(rank: int, records: list, budget: int) -> tuple[dict, int, int]:
    """A rank's process description with its newest spans records -> (proc, evicted, profiler drops)."""
    starts = of_type(records, RUN_START)
    for rs in starts:
        try:
            check_schema(rs, f"rank {rank} log")
        except ValueError as exc:
            raise TraceInputError(str(exc)) from None
    proc = proc_info(rank, starts[-1] if starts else next((r for r in records if r.get("role")), {}))
    spans = of_type(records, SPANS)
    proc["records"], _, evicted = newest_within(spans, budget)
    proc["segments"] = len(starts)
    return proc, evicted, sum(int(num(r.get("dropped")) or 0) for r in spans)


def merge_traces(run_dir, out_path=None, max_events: int = MAX_EVENTS) -> dict:
    """One trace for every rank of a run, built from RUN_DIR/profile/rank*.jsonl (so it also works after
    a crash, when per-rank trace files may be stale) and written to out_path (default
    RUN_DIR/trace/merged.json). Returns a summary; TraceInputError for a directory with no run logs."""
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


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):             # one line, no usage dump; main() turns it into exit 2
        raise _UsageError(message)


def main(argv=None, prog: str = None) -> int:
    """`merge RUN_DIR [-o FILE]`: 0 written, 1 cannot write, 2 bad usage or no run logs (one line).
    `prog` names the command in messages (dflash-report passes its own)."""
    prog = prog or PROG
    parser = _Parser(prog=prog, description="Perfetto/Chrome traces of a dflash run's detail windows.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="one trace for every rank, from the run logs")
    merge.add_argument("run_dir", help="the run directory (holds profile/rank*.jsonl)")
    merge.add_argument("-o", "--output", help="output file (default RUN_DIR/trace/merged.json)")
    try:
        args = parser.parse_args(argv)
        s = merge_traces(args.run_dir, args.output)
    except SystemExit as exc:              # --help
        return exc.code if isinstance(exc.code, int) else 0
    except (_UsageError, TraceInputError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: cannot write the trace: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {s['out']}: {len(s['ranks'])} ranks, {s['spans']} spans, {s['events']} events, "
          f"flows {s['flows_matched']} matched / {s['flows_unmatched']} unmatched"
          + (f", {s['bad_lines']} unreadable run-log lines skipped" if s["bad_lines"] else ""))
    if not s["spans"]:
        print(f"{prog}: note: no spans records (a detail window is written at each interval's close)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
