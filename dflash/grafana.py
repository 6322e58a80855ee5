"""`python -m dflash.grafana`: the monitoring mixin's generated files from the pipeline's wait spans
(dflash/pipeline.py) and the metric catalog, so a new wait span reaches the dashboard and the rules with its row.

    python -m dflash.grafana [--check]     both files: grafana/dflash.json and grafana/dflash.rules.yml
    python -m dflash.grafana dashboard [--out FILE] [--check]
    python -m dflash.grafana rules [--out FILE] [--time-scale F] [--runbook-base URL] [--check]

`--check` writes nothing and exits 1 when a file differs from what would be generated (exporters/dashboard.py,
exporters/rules.py).
"""
from __future__ import annotations

import argparse
import sys

from dflash import pipeline
from exporters import dashboard, rules

GENERATORS = {"dashboard": dashboard.main, "rules": rules.main}
"""Each file's generator: its command line, given the wait spans and the command that names it."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    waits = pipeline.wait_spans()
    if argv[:1] and argv[0] in GENERATORS:
        return GENERATORS[argv[0]](argv[1:], waits, f"dflash.grafana {argv[0]}")
    parser = argparse.ArgumentParser(prog="python -m dflash.grafana", description=__doc__.split("\n")[0],
                                     epilog="dashboard ... / rules ...: one file, with its own options (--help)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    args = parser.parse_args(argv)
    check = ["--check"] if args.check else []
    return max([generate(check, waits, f"dflash.grafana {name}") for name, generate in GENERATORS.items()])


if __name__ == "__main__":
    sys.exit(main())
