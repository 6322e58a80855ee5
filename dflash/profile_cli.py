"""`dflash-profile`: parse, run, print, keep. The logic lives in profiler.snapshot and profiler.overhead
(no torch here).

    dflash-profile snapshot --pid PID | --run-dir DIR [--native] [--json] [--out FILE]
    dflash-profile overhead --pid PID | --run-dir DIR [--pairs N] [--phase-s S] [--settle-s S] [--max-s S]
                            [--part PART] [--json] [--out FILE]

Human output by default; --json prints the result as JSON; --out FILE also writes the JSON to FILE.
snapshot: each snapshot of a profiled process is kept under RUN_DIR/snapshots/ and recorded in its run log.
Exit 0 on success; 2 with a one-line reason when nothing could be snapshotted (no such pid, tracing
not permitted, py-spy missing, not a Python process, no live rank); 1 when py-spy failed otherwise.
overhead: profiled and paused phases alternated inside the live run (profiler/overhead.py). Exit 2 with
one line before any phase (no such pid, no endpoint, rank 0 missing, paused by another client, bad
numbers); 1 when the run stalled or ended before two whole pairs; every rank is resumed on every exit.
SIGTERM or SIGINT stops it after the current phase with the whole pairs so far (a second one, at once);
so does --max-s, before a pair that would end past it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys

from profiler.snapshot import (format_process, format_run, keep_snapshot, snapshot_process,
                               snapshot_run)
from profiler.stacks import FAILED, StackError


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"a pid is a positive integer, got {text!r}")
    return int(text)


def _seconds(low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected seconds in [{low:g}, {high:g}], got {text!r}")
        return value
    return parse


def _pairs(text: str) -> int:
    if not text.isdigit() or not 2 <= int(text) <= 10000:
        raise argparse.ArgumentTypeError(f"expected a whole number of pairs from 2 to 10000, got {text!r}")
    return int(text)


def _add_target(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=_pid, help="one process (a rank of a run, or any Python process)")
    target.add_argument("--run-dir", metavar="DIR", help="every live rank of the run in DIR")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-profile", description="Look inside a live dflash-train run.")
    sub = p.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="every thread's open spans and Python stack, merged per thread",
                          description="A live process's state from its control endpoint merged with "
                                      "`py-spy dump` stacks, per thread; stuck spans flagged.")
    _add_target(snap)
    snap.add_argument("--native", action="store_true", help="include native frames (slower: about 1 s)")
    over = sub.add_parser("overhead", help="what profiling costs this run: profiled and paused phases alternated",
                          description="Alternate profiled and paused phases (ABBA) on every live rank of a run "
                                      "and compare rank 0's step rate: the paired difference with a 95% interval.")
    _add_target(over)
    over.add_argument("--pairs", type=_pairs, default=20, help="on/off pairs (default 20)")
    over.add_argument("--phase-s", type=_seconds(0.05, 600), default=3.0, help="measured seconds per phase (3)")
    over.add_argument("--settle-s", type=_seconds(0, 600), default=1.0,
                      help="seconds after each switch before measuring (1): the queues reach the new state")
    over.add_argument("--max-s", type=_seconds(1, 86400), default=None,
                      help="a time budget: no pair is begun that would end past it (at least two pairs run)")
    over.add_argument("--part", choices=("all", "inline", "background", "gpu", "none"), default="all",
                      help="what the off phases pause: all (--no-profile's path; default), inline (the training "
                           "threads' spans, counters, checks), background (collector, interval clock, samplers), "
                           "gpu (the spans' CUDA events: CPU spans) or none (an A/A run: the measurement's own "
                           "bias)")
    return p


def take(args, runner=None) -> dict:
    """The snapshot (one process, or {"ranks": [...]} for a run), each rank's copy kept."""
    if args.pid is not None:
        snap = snapshot_process(args.pid, native=args.native, runner=runner)
        keep_snapshot(snap)
        return snap
    run = snapshot_run(args.run_dir, native=args.native, runner=runner)
    for snap in run["ranks"]:
        keep_snapshot(snap)
    return run


def overhead(args) -> dict:
    """The in-run on/off measurement of the run that args.pid or args.run_dir names (profiler/overhead.py)."""
    from profiler import overhead as oh
    from profiler.taskcpu import TaskCpu

    lease_s = oh.lease_for(args.part, args.settle_s, args.phase_s)
    oh.check_budget(args.max_s, args.settle_s, args.phase_s)
    run_dir, ranks = oh.find_run(args.pid, args.run_dir)
    endpoints = oh.RunEndpoints(ranks, oh.owner_name(), lease_s, part=args.part)
    probe = TaskCpu({r.get("rank"): r["pid"] for r in ranks})
    stop = _StopOnSignal()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = oh.measure(endpoints, args.pairs, args.settle_s, args.phase_s, on_phase=_progress_line, probe=probe,
                            max_s=args.max_s, stop_requested=stop.why)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return {"run_dir": run_dir, "ranks": len(ranks), "lease_s": lease_s, **result}


class _StopOnSignal:
    """SIGTERM/SIGINT handler: the first asks the measurement to stop before its next phase (the whole pairs
    so far are the result); a second exits at once, unwinding through measure()'s resume of every rank."""

    def __init__(self):
        self.signal_name = None

    def __call__(self, signum, frame):
        if self.signal_name is not None:
            raise SystemExit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        # os.write, not print: a handler may run inside another write to stderr (a reentrant print raises)
        os.write(2, f"dflash-profile overhead: {self.signal_name}: stopping after this phase "
                    "(again to stop now)\n".encode())

    def why(self) -> str | None:
        return None if self.signal_name is None else f"stopped by {self.signal_name}"


def _progress_line(index: int, phase) -> None:
    print(f"dflash-profile overhead: phase {index + 1} {phase.arm:<3} {phase.steps_per_s:.2f} steps/s "
          f"({phase.steps} steps in {phase.seconds:.2f} s)", file=sys.stderr, flush=True)


def _out_unwritable(path: str | None) -> str | None:
    """Why --out cannot be written (checked before a measurement of minutes), or None."""
    if path is None:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--out {path}: is a directory"
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"--out {path}: cannot write in {parent}"
    return None


def main(argv: list[str] | None = None, runner=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "overhead":
        return _main_overhead(args)
    try:
        result = take(args, runner)
    except StackError as exc:
        print(f"dflash-profile: error: {exc}", file=sys.stderr)
        return 1 if exc.kind == FAILED else 2
    return _emit(args, result, format_run if "ranks" in result else format_process)


def _main_overhead(args) -> int:
    from profiler.overhead import OverheadError, format_result

    bad_out = _out_unwritable(args.out)
    if bad_out is not None:
        print(f"dflash-profile: error: {bad_out}", file=sys.stderr)
        return 2
    try:
        result = overhead(args)
    except (StackError, OverheadError) as exc:
        print(f"dflash-profile: error: {exc}", file=sys.stderr)
        return 1 if getattr(exc, "started", False) or getattr(exc, "kind", None) == FAILED else 2
    code = _emit(args, result, format_result)
    return code or (1 if result["resume_failed"] else 0)


def _emit(args, result: dict, formatter) -> int:
    """Write --out (exit 2 when it cannot), print text or --json."""
    text = json.dumps(result, indent=1)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            print(f"dflash-profile: error: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    print(text if args.json else formatter(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
