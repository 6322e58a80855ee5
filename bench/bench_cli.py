"""How long the CLIs take to answer a mistake that needs no torch (issue 51: under 0.5 s), against the floor
measured in the same run: a bare `python -c pass` of the same interpreter.

    python bench/bench_cli.py [--repeat N]

Each case is one fresh process, run N times (default 5), the median and the worst printed with the floor's. The
cases are tests/dflash/test_fast_errors.py's (that test asserts torch is never imported on the way; this one
says what the user waits).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.dflash.test_fast_errors import cases  # noqa: E402

REPORT_CASES = {"dflash-report: a directory with no run": ["-m", "dflash.report_cli", "hotspots", "{tmp}/empty"],
                "dflash-report: a mistyped subcommand": ["-m", "dflash.report_cli", "hotspot", "x"],
                "dflash-profile: no such pid": ["-m", "dflash.profile_cli", "snapshot", "--pid", "999999999"]}


def seconds(argv: list, cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=cwd, capture_output=True, timeout=300,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(cwd),
                        "XDG_CACHE_HOME": str(cwd / "cache")})
    return time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rows = {"floor: python -c pass": [sys.executable, "-c", "pass"]}
        rows.update({f"dflash-train: {name}": [sys.executable, "-m", "dflash.cli", *argv]
                     for name, argv in cases(tmp).items()})
        rows.update({name: [sys.executable, *(a.format(tmp=tmp) for a in argv)] for name, argv in REPORT_CASES.items()})
        for name, argv in rows.items():
            took = [seconds(argv, tmp) for _ in range(args.repeat)]
            print(f"{name}: median {statistics.median(took):.3f} s, worst {max(took):.3f} s "
                  f"({args.repeat} runs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
