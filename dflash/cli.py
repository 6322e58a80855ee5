"""`dflash-train`: parse, build, run, close. The logic lives in dflash.launch and dflash.worker."""

from __future__ import annotations

import argparse
import os
import sys
import time

from dflash import handoff
from dflash.cli_output import Parser, quiet_on_closed_pipe, whole_lines
from dflash.config import ConfigError, add_config_flags, config_from_args
from profiler.schema.records import printable


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dflash-train",
        description="Train a DFlash drafter against a frozen target, instrumented end to end. With no "
                    "arguments: the built-in tiny target and synthetic corpus on whatever devices exist.",
        epilog="Of an on/off pair given twice (--resume --no-resume), the last one wins. Bad input exits 2 "
               "with one line, before any rank does work. SIGTERM or SIGINT: the step in progress is finished and "
               "checkpointed, evaluation skipped, the resume command printed and the run exits 0, all within "
               "--stop-timeout-s (else exit 1 with the previous checkpoint as latest). With stdout closed "
               "(dflash-train | head) the run trains on to its end and stops printing.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file: a mapping of sections "
                   "{optim: {lr: ...}} or of flag keys {lr: ...} (flags > env > file; an error names FILE:LINE) "
                   "(default: none)")
    add_config_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    started_ns = time.time_ns()   # the start-up timeline's origin (dflash/startup.py)
    whole_lines(sys.stderr)   # its lines and its ranks' share one stderr, under PYTHONUNBUFFERED too
    with quiet_on_closed_pipe():   # `dflash-train | head`: the run goes on, silently
        return _main(argv, started_ns)


def _main(argv: list[str] | None, started_ns: int) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
            with handoff.long_lived():   # the imports, as a rank started by dflash.launch does them
                from dflash import preflight, worker

            world = int(os.environ["WORLD_SIZE"])
            preflight.check(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            os.umask(handoff.RUN_UMASK)  # what this rank writes is private to this user
            try:
                return worker.run(cfg)
            finally:
                worker.ignore_further_signals()   # a late signal must not kill the exit (dflash/stopping.py)
        from dflash import launch

        return launch.launch(cfg, started_ns)  # preflight first, then one process per rank
    except ConfigError as e:   # escaped: a value from a file or argv may hold a terminal's control sequence
        print(printable(f"dflash-train: error: {e}").replace("\n", "\\n"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
