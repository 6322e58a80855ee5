"""`dflash-profile`: parse, run, print, keep. The logic lives in profiler.snapshot (no torch here).

    dflash-profile snapshot --pid PID | --run-dir DIR [--native] [--json] [--out FILE]

Human output by default; --json prints the result as JSON; --out FILE also writes the JSON to FILE.
snapshot: each snapshot of a profiled process is kept under RUN_DIR/snapshots/ and recorded in its run log.
Exit 0 on success; 2 with a one-line reason when nothing could be snapshotted (no such pid, tracing
not permitted, py-spy missing, not a Python process, no live rank); 1 when py-spy failed otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash.cli_output import cli_output

from profiler.snapshot import (format_process, format_run, keep_snapshot, snapshot_process,
                               snapshot_run)
from profiler.stacks import FAILED, StackError

# Span contract (DESIGN.md): the spans in which a rank waits on ranks of another role.
WAITS_FOR_ROLE = {"drafter.recv": "target", "transfer.wait_slot": "drafter", "transfer.send": "drafter",
                  "drafter.allreduce": "drafter"}


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"a pid is a positive integer, got {text!r}")
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
    return p


def take(args, runner=None) -> dict:
    """The snapshot (one process, or {"ranks": [...]} for a run), each rank's copy kept."""
    if args.pid is not None:
        snap = snapshot_process(args.pid, native=args.native, runner=runner)
        keep_snapshot(snap)
        return snap
    run = snapshot_run(args.run_dir, WAITS_FOR_ROLE, native=args.native, runner=runner)
    for snap in run["ranks"]:
        keep_snapshot(snap)
    return run


def main(argv: list[str] | None = None, runner=None) -> int:
    args = build_parser().parse_args(argv)
    with cli_output():
        try:
            result = take(args, runner)
        except StackError as exc:
            print(f"dflash-profile: error: {exc}", file=sys.stderr)
            return 1 if exc.kind == FAILED else 2
        return _emit(args, result, format_run if "ranks" in result else format_process)


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
