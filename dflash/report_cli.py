"""`dflash-report`: parse, build, run, print. The analyses live in report/ (docs/REPORT.md).

    dflash-report hotspots RUN_DIR [--json] [--top N] [--compare BASELINE_DIR] [--plot FILE] [--gpus N]
    dflash-report compare A B [--json]         the A/B verdict of two runs (report.compare; = hotspots B --compare A)
    dflash-report trace RUN_DIR [-o FILE]      one Perfetto trace of every rank (report.trace)
    dflash-report check RUN_DIR [--json] [--compare BASELINE_DIR]   the run's invariants (report.check): one
                                               line per violation (and a compare's, against BASELINE_DIR)
    dflash-report kernels RUN_DIR [--capture N] [--top N] [--json]   a Kineto capture per span (report.kernels)
    dflash-report memory RUN_DIR [--top N] [--json]     the allocator snapshots (report.memory_snapshot)
    dflash-report stacks RUN_DIR [-o FILE] [--folded] [--role ROLE] [--profiler-threads] [--running-only]
                         [--snapshots]           flame graphs of the stack samples (report.stacks)
    dflash-report html RUN_DIR [-o FILE] [--compare BASELINE_DIR] [--top N] [--gpus N]   one self-contained HTML
                                               page of hotspots with plots (report.html; default RUN_DIR/report.html)

Exit 0 on success, 2 for a missing, empty or foreign run directory or bad usage (one line, no traceback),
1 when the trace cannot be written or an invariant does not hold.
Never imports torch: it reads the run logs with the standard library.
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash.cli_output import Parser, cli_output, exit_status


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="dflash-report", description="Answers from a dflash-train run's logs.")
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hotspots", help="where the time goes, what bounds the pipeline, memory, findings")
    h.add_argument("run_dir", metavar="RUN_DIR")
    h.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/REPORT.md)")
    h.add_argument("--top", type=_positive_int, metavar="N", help="show the N spans with the most time")
    h.add_argument("--compare", metavar="BASELINE_DIR", help="A/B table: BASELINE_DIR is A, RUN_DIR is B")
    h.add_argument("--plot", metavar="FILE", help="write a PNG of span time, tokens/s and headroom over time")
    h.add_argument("--gpus", type=_positive_int, metavar="N",
                   help="GPU count for the split advice (default: the run's)")
    cp = sub.add_parser("compare", help="A/B verdict of two runs: spans, tokens/s and GPU memory (A the baseline)")
    cp.add_argument("run_a", metavar="A", help="the baseline run directory")
    cp.add_argument("run_b", metavar="B", help="the run compared with it")
    cp.add_argument("--json", action="store_true", help="print the table as JSON (docs/REPORT.md)")
    t = sub.add_parser("trace", help="merge every rank's detail spans into one Perfetto/Chrome trace")
    t.add_argument("run_dir", metavar="RUN_DIR")
    t.add_argument("-o", "--output", metavar="FILE", help="output file (default RUN_DIR/trace/merged.json)")
    c = sub.add_parser("check", help="the invariants every figure of a run must keep: one line per violation")
    c.add_argument("run_dir", metavar="RUN_DIR")
    c.add_argument("--json", action="store_true", help="print violations, notes and counts as JSON")
    c.add_argument("--compare", metavar="BASELINE_DIR",
                   help="also the compare invariants of BASELINE_DIR (A) against RUN_DIR (B)")
    k = sub.add_parser("kernels", help="one Kineto capture per rank and span: kernels, copies, idle and launch time")
    k.add_argument("run_dir", metavar="RUN_DIR")
    k.add_argument("--capture", type=int, metavar="N", help="the capture that begins at step N (default: the latest)")
    k.add_argument("--top", type=_positive_int, default=8, metavar="N", help="kernels and CPU ops per span (8)")
    k.add_argument("--json", action="store_true", help="print the breakdown as JSON (docs/REPORT.md)")
    m = sub.add_parser("memory", help="the CUDA allocator snapshots under RUN_DIR/forensics, read without running them")
    m.add_argument("run_dir", metavar="RUN_DIR")
    m.add_argument("--top", type=_positive_int, default=10, metavar="N", help="largest live blocks shown (10)")
    m.add_argument("--json", action="store_true", help="print the summaries as JSON (docs/REPORT.md)")
    _stacks_parser(sub)
    _html_parser(sub)
    return p


def _html_parser(sub) -> None:
    w = sub.add_parser("html", help="one self-contained HTML page: hotspots' sections, plots over time, trace links")
    w.add_argument("run_dir", metavar="RUN_DIR")
    w.add_argument("-o", "--output", metavar="FILE", help="output file (default RUN_DIR/report.html)")
    w.add_argument("--compare", metavar="BASELINE_DIR", help="add the A/B table: BASELINE_DIR is A, RUN_DIR is B")
    w.add_argument("--top", type=_positive_int, metavar="N", help="show the N spans with the most time")
    w.add_argument("--gpus", type=_positive_int, metavar="N",
                   help="GPU count for the split advice (default: the run's)")


def _stacks_parser(sub) -> None:
    s = sub.add_parser("stacks", help="flame graphs of host time: the stack samples as speedscope JSON or folded")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("-o", "--output", metavar="FILE", help="output file, - for stdout (default "
                   "RUN_DIR/stacks/stacks.speedscope.json, or stacks.folded with --folded)")
    s.add_argument("--folded", action="store_true", help="folded stacks (flamegraph.pl, inferno), not speedscope JSON")
    s.add_argument("--role", metavar="ROLE", help="only the ranks of this role")
    s.add_argument("--profiler-threads", action="store_true",
                   help="also the profiler's own threads, as profiles of their own marked [profiler]")
    s.add_argument("--running-only", action="store_true",
                   help="leave out the samples where a thread waited (CPU time, not wall time)")
    s.add_argument("--snapshots", action="store_true",
                   help="also the dflash-profile snapshot records, one sample per thread, as profiles of their own")


def _hotspots(args) -> int:
    from profiler import report
    from dflash.advice import ADVICE

    rep = report.hotspots(args.run_dir, top=args.top, n_gpus=args.gpus, advice=ADVICE)
    table = report.compare(args.compare, args.run_dir) if args.compare else None
    if args.plot:
        try:
            report.plot(args.run_dir, args.plot)
        except ImportError as e:
            raise report.ReportError(f"--plot needs matplotlib ({e})") from None
        except OSError as e:
            raise report.ReportError(f"--plot: cannot write {args.plot}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps({**rep, "compare": table} if table else rep, indent=1, allow_nan=False))
    else:
        print(report.format_hotspots(rep))
        if table:
            print("\n" + report.format_compare(table))
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _compare(args) -> int:
    from profiler import report

    table = report.compare(args.run_a, args.run_b)
    print(json.dumps(table, indent=1, allow_nan=False) if args.json else report.format_compare(table))
    return 0


def _trace(args) -> int:
    from profiler.report.trace import merge_traces

    try:
        s = merge_traces(args.run_dir, args.output)
    except OSError as e:
        print(f"dflash-report: error: cannot write the trace: {e}", file=sys.stderr)
        return 1
    print(f"wrote {s['out']}: {len(s['ranks'])} ranks, {s['spans']} spans, {s['events']} events, "
          f"flows {s['flows_matched']} matched / {s['flows_unmatched']} unmatched"
          + (f", {s['bad_lines']} unreadable run-log lines skipped" if s["bad_lines"] else ""))
    if not s["spans"]:
        print("dflash-report: note: no spans records (a detail window is written at each interval's close)",
              file=sys.stderr)
    return 0


def _check(args) -> int:
    """Exit 1 when an invariant does not hold; notes (what the log cannot hold) go to stderr."""
    from profiler.report.check import check, check_compare

    res = check(args.run_dir)
    if args.compare:
        pair = check_compare(args.compare, args.run_dir)
        res.violations += pair.violations
        res.notes += [n for n in pair.notes if n not in res.notes]
        res.checked += pair.checked
    code = exit_status(1 if res.violations else 0)   # before printing: a closed pipe still ends with it
    if args.json:
        print(json.dumps(res.to_json(), indent=1, allow_nan=False))
    else:
        for v in res.violations:
            print(f"check: {v}")
        if not res.violations:
            print(res.summary())
        for line in res.notes:
            print(f"check: note: {line}", file=sys.stderr)
    return code


def _kernels(args) -> int:
    from profiler import report

    rep = report.kernels(args.run_dir, args.capture, args.top)
    print(json.dumps(rep, indent=1, allow_nan=False) if args.json else report.format_kernels(rep))
    return 0


def _memory(args) -> int:
    from profiler import report

    rep = report.memory(args.run_dir, args.top)
    print(json.dumps(rep, indent=1, allow_nan=False) if args.json else report.format_memory(rep))
    return 0


def _stacks(args) -> int:
    from profiler.report import stacks

    text, got = stacks.render(args.run_dir, args.folded, args.role, args.profiler_threads, args.running_only,
                              args.snapshots)
    if args.output == "-":
        sys.stdout.write(text)
        print(f"wrote stdout: {got.summary_line()}", file=sys.stderr)
        return 0
    try:
        path = stacks.write(text, args.output or stacks.default_path(args.run_dir, args.folded))
    except OSError as e:
        print(f"dflash-report: error: cannot write the stacks: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}: {got.summary_line()}")
    return 0


def _html(args) -> int:
    from profiler.report.html import write_html
    from dflash.advice import ADVICE

    s = write_html(args.run_dir, args.output, top=args.top, n_gpus=args.gpus, advice=ADVICE,
                   baseline_dir=args.compare)
    print(f"wrote {s['out']}: {s['bytes'] / 1e6:.2f} MB, {s['figures']} plots")
    return 0


COMMANDS = {"hotspots": _hotspots, "compare": _compare, "trace": _trace, "check": _check, "kernels": _kernels,
            "memory": _memory, "stacks": _stacks, "html": _html}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from profiler.report.runs import ReportError

    with cli_output():
        try:
            return COMMANDS[args.command](args)
        except ReportError as e:
            print(f"dflash-report: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
