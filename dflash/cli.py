"""`dflash-train`: parse, build, run, close. The logic lives in dflash.launch and dflash.worker."""

from __future__ import annotations

import argparse
import os
import sys

from dflash.config import ConfigError, add_config_flags, config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train a DFlash drafter against a frozen target, instrumented end to end. With no "
                    "arguments: the built-in tiny target and synthetic corpus on whatever devices exist.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file of config fields (flags > env > file)")
    add_config_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
            from dflash import worker

            return worker.run(cfg)
        from dflash import launch

        return launch.launch(cfg)
    except ConfigError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
