"""`dflash-profile`: parse, run, print, keep. The logic lives in profiler.clients (snapshot, capture_client, top) and,
for the memory forecast, dflash.memory_watch (no torch here).

    dflash-profile snapshot --pid PID | --run-dir DIR [--native] [--json] [--out FILE]
    dflash-profile capture --pid PID | --run-dir DIR [--steps K] [--at-step N] [--memory] [--no-wait]
    dflash-profile memory --pid PID | --run-dir DIR
    dflash-profile top --pid PID | --run-dir DIR [--interval S] [--window S] [--once]

Human output by default; --json prints the result as JSON; --out FILE also writes the JSON to FILE.
snapshot: each snapshot of a profiled process is kept under RUN_DIR/snapshots/ and recorded in its run log.
Exit 0 on success; 2 with a one-line reason when nothing could be snapshotted (no such pid, tracing
not permitted, py-spy missing, not a Python process, no live rank); 1 when py-spy failed otherwise.
capture: every rank records steps N..N+K-1 into RUN_DIR/kineto/rank{R}-step{N}.json.gz; exit 2 (one line) when
no rank can be armed (not a dflash rank, the run ended, bad --steps, a rank past --at-step), 1 when a rank
armed but wrote no trace. memory: each GPU rank's allocator snapshot under RUN_DIR/forensics/, then the memory
forecast from the run's logs so far (the largest --tokens-per-batch, --max-length, --num-anchors that fit, or why
there is none yet); exit 2 when no rank could save a snapshot (a CPU run).
top: a live view of every rank (profiler.clients.top), refreshed every --interval s; --once prints one plain
frame; exit 2 (one line) for a bad --interval or --window, a pid that is no rank of ours, a run without a live rank.
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash import memory_watch, pipeline
from dflash.cli_output import Parser, cli_output, exit_status

from profiler.clients import capture_client, top

from profiler.schema import views
from profiler.capture import MAX_STEPS
from profiler.clients.capture_client import CaptureError
from profiler.clients.snapshot import (format_process, format_run, keep_snapshot, snapshot_process,
                               snapshot_run)
from profiler.stacks import FAILED, StackError


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
    p = Parser(prog="dflash-profile", description="Look inside a live dflash-train run.")
    sub = p.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="every thread's open spans and Python stack, merged per thread",
                          description="A live process's state from its control endpoint merged with "
                                      "`py-spy dump` stacks, per thread; stuck spans flagged.")
    _add_target(snap)
    snap.add_argument("--native", action="store_true", help="include native frames (slower: about 1 s)")
    cap = sub.add_parser("capture", help="a Kineto trace of K steps from every rank, all from the same step",
                         description="Every live rank records steps N..N+K-1 with torch.profiler (our spans as "
                                     "user annotations) into RUN_DIR/kineto/rank{R}-step{N}.json.gz.")
    _add_target(cap)
    cap.add_argument("--steps", type=int, default=3, metavar="K", help=f"steps to record, 1 to {MAX_STEPS} (default 3)")
    cap.add_argument("--at-step", type=int, metavar="N", help="the first step (default: the next multiple of "
                                                              "--round past the furthest rank)")
    cap.add_argument("--round", type=int, default=capture_client.ROUND_TO, metavar="M",
                     help=f"start on a multiple of M (default {capture_client.ROUND_TO})")
    cap.add_argument("--memory", action="store_true", help="also every allocation and free (profile_memory)")
    cap.add_argument("--record-shapes", action="store_true", help="also each op's input shapes")
    cap.add_argument("--with-stack", action="store_true", help="also each op's Python stack")
    cap.add_argument("--no-wait", action="store_true", help="arm the ranks and return; do not wait for the files")
    cap.add_argument("--timeout", type=float, default=600.0, metavar="S",
                     help="seconds to wait for every rank's trace (default 600)")
    mem = sub.add_parser("memory", help="each GPU rank's CUDA allocator snapshot, for pytorch.org/memory_viz",
                         description="Each GPU rank saves torch.cuda.memory._snapshot() under RUN_DIR/forensics/ "
                                     "(with the allocation history under --memory-history N); then the memory "
                                     "forecast from the run's logs so far.")
    _add_target(mem)
    live = sub.add_parser("top", help="a live view of every rank: step, rates, open spans, GPU, the bound stage",
                          description="Every rank's step, tokens/s over its own recent ticks, open spans with their "
                                      "ages (stuck ones flagged), GPU busy and memory, and the bound stage, refreshed "
                                      "from the control endpoints. Keys: q quits, s sorts by the next column, r "
                                      "reverses.")
    who = live.add_mutually_exclusive_group(required=True)
    who.add_argument("--pid", type=_pid, help="one rank")
    who.add_argument("--run-dir", metavar="DIR", help="every live rank of the run in DIR")
    live.add_argument("--interval", type=float, default=top.DEFAULT_INTERVAL_S, metavar="S",
                      help=f"seconds between refreshes (default {top.DEFAULT_INTERVAL_S:g})")
    live.add_argument("--window", type=float, default=top.WINDOW_S, metavar="S",
                      help=f"how far back rates and busy shares reach, seconds (default {top.WINDOW_S:g})")
    live.add_argument("--once", action="store_true", help="print one plain frame and exit (for scripts)")
    return p


def take(args, runner=None) -> dict:
    """The snapshot (one process, or {"ranks": [...]} for a run), each rank's copy kept."""
    if args.pid is not None:
        snap = snapshot_process(args.pid, native=args.native, runner=runner)
        keep_snapshot(snap)
        return snap
    run = snapshot_run(args.run_dir, pipeline.waits_for_role(), native=args.native, runner=runner)
    for snap in run["ranks"]:
        keep_snapshot(snap)
    return run


def capture(args) -> tuple[dict, int]:
    """Arm every rank at one step and (unless --no-wait) wait for their traces; exit 1 when a rank wrote none."""
    if not 1 <= args.steps <= MAX_STEPS:
        raise CaptureError(f"--steps must be from 1 to {MAX_STEPS}, got {args.steps}")
    if args.at_step is not None and args.at_step < 0 or args.round < 1 or not args.timeout > 0:
        raise CaptureError("--at-step must be >= 0, --round >= 1 and --timeout > 0")
    records = capture_client.ranks_of(args.pid, args.run_dir)
    tails = capture_client.tails_of(records)   # opened before arming: no event is missed
    options = {"memory": args.memory, "shapes": args.record_shapes, "stacks": args.with_stack}
    armed = capture_client.arm(records, args.steps, args.at_step, args.round, options)
    n = armed["at_step"]
    ranks = armed["replies"] if args.no_wait else capture_client.wait(records, n, args.timeout, tails)
    # each answer a capture event, the client's {"rank", "role", "pid", "error"} or the armed reply: all say `error`
    return {"at_step": n, "steps": args.steps, "ranks": ranks}, int(any(views.Capture.of(r).error for r in ranks))


def memory(args) -> tuple[dict, int]:
    """Every rank's allocator snapshot; exit 2 when none could be saved (CPU ranks say why)."""
    records = capture_client.ranks_of(args.pid, args.run_dir)
    replies = capture_client.memory(records)
    forecast = memory_watch.live_fields(args.run_dir or records[0]["run_dir"])
    return {"ranks": replies, "forecast": forecast}, 0 if any(r.get("ok") for r in replies) else 2


def main(argv: list[str] | None = None, runner=None) -> int:
    args = build_parser().parse_args(argv)
    with cli_output():
        if args.command == "top":
            return _top(args)
        if args.command != "snapshot":
            return _drill(args)
        try:
            result = take(args, runner)
        except StackError as exc:
            print(f"dflash-profile: error: {exc}", file=sys.stderr)
            return 1 if exc.kind == FAILED else 2
        return _emit(args, result, format_run if "ranks" in result else format_process)


def _top(args) -> int:
    try:
        return top.run(args.pid, args.run_dir, args.interval, args.window, args.once, pipeline.wait_spans())
    except top.TopError as exc:
        print(f"dflash-profile: error: {exc}", file=sys.stderr)
        return 2


def _drill(args) -> int:
    """capture / memory: a one-line error and exit 2 before anything is armed or saved."""
    command, formatter = ((capture, lambda r: capture_client.format_capture(r)) if args.command == "capture" else
                          (memory, lambda r: "\n".join([capture_client.format_memory(r["ranks"]),
                                                         *memory_watch.live_lines(r["forecast"])])))
    try:
        result, code = command(args)
    except CaptureError as exc:
        print(f"dflash-profile: error: {exc}", file=sys.stderr)
        return 2
    exit_status(code)   # before printing: a closed pipe still ends with it
    return _emit(args, result, formatter) or code


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
