"""What the benchmark scripts share: the repository on sys.path, one-line argument errors, integer settings
from the environment, a dflash-train subprocess, a rank's run-log records, the JSON left in $OUT and a
Markdown table (the form bench/RESULTS.md takes a figure in).

The scripts run as `python3 bench/NAME.py`, so this directory is first on sys.path and `import common`
finds this module; importing it puts the repository root on sys.path too, for `dflash` and `profiler`.
Standard library only: scripts that need no torch stay without it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line on stderr and exit status 2, before any work (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a script whose module docstring is `doc`: `--help` prints that docstring as written."""
    return _OneLineParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def env_int(name: str, default: int, least: int) -> int:
    """An integer setting from the environment; bad input is one line on stderr and exit 2."""
    text = os.environ.get(name, str(default))
    if not text.strip().isdigit() or int(text) < least:
        print(f"{Path(sys.argv[0]).stem}: {name}={text!r} must be an integer >= {least}", file=sys.stderr)
        sys.exit(2)
    return int(text)


def train(run_dir: Path, args: list, env: dict | None = None, wait: bool = True, **kw):
    """`python -m dflash.cli --run-dir RUN_DIR ARGS` with this interpreter and this checkout first on
    PYTHONPATH, `env` added to the environment: run to its end (subprocess.run's result), or only started
    (a Popen) with `wait=False`; `kw` go to subprocess."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "dflash.cli", "--run-dir", str(run_dir), *map(str, args)]
    kw.update(cwd=REPO, env=dict(os.environ, PYTHONPATH=path, **(env or {})))
    return subprocess.run(cmd, **kw) if wait else subprocess.Popen(cmd, **kw)


def records(run_dir: Path, rank: int = 0, rtype: str | None = None, kind: str | None = None) -> list[dict]:
    """Rank `rank`'s run-log records of type `rtype` (and event `kind`), every one when None; [] before the
    log exists."""
    from profiler.schema.records import read_records   # standard library only

    log = Path(run_dir) / "profile" / f"rank{rank}.jsonl"
    recs = read_records(log)[0] if log.is_file() else []
    return [r for r in recs if rtype in (None, r.get("type")) and kind in (None, r.get("kind"))]


def write_out(name: str, data) -> None:
    """`data` as JSON in $OUT/NAME when $OUT is set (the folder a device call sends back)."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(data, indent=2) + "\n")


def quantile(values: list, q: float) -> float:
    """The nearest-rank `q` quantile of `values` (0.5 the median's upper neighbour, 1.0 the max)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table of `rows`, each cell already formatted (or turned into text with str)."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)
