"""What profiling costs a whole run: dflash-train with the profiler on against `--no-profile`, in pairs.

    python3 bench/overhead_ab.py [--pairs 6] [--aa] [--workdir DIR] [--keep-runs] [-- DFLASH-TRAIN ARGS...]

Each run is `python -m dflash.cli --run-dir RUN ARGS` (this interpreter, this checkout first on
PYTHONPATH), the two arms differing only in `--no-profile`. Pairs alternate their order (ABBA: on, off,
off, on, ...), so a drift of the machine over the session enters both arms alike. A run's figure is the
drafter tokens/s summed over its drafter ranks' RUN_DIR/throughput/rank*.json (the meter writes one per
rank, with or without the profiler; `steady_tokens_per_s` is the steady state: after warm-up, compile and
checkpoint time left out). Printed:
each pair's on/off ratio, their median, min..max and a bootstrap 95% interval of the median (10,000
resamples of the pairs). `--aa` adds, after each A/B pair, a pair of two identical `--no-profile` runs:
the floor, what this harness reads on this machine when nothing differs. A ratio below 1 is a cost.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable

import numpy as np

import common

METRIC = "steady_tokens_per_s"   # the meter's steady state: after warm-up, compile and checkpoint time
OWNED_FLAGS = ("--run-dir", "--profile", "--no-profile")   # set by this script, per arm
DEFAULT_TRAIN = ["--device", "cpu", "--max-steps", "40", "--eval-prompts", "0", "--builtin-conversations", "64"]


def drafter_tokens_per_s(run_dir: Path) -> float:
    """The run's drafter tokens/s: METRIC summed over every drafter rank file the meter wrote."""
    files = [json.loads(f.read_text()) for f in sorted((run_dir / "throughput").glob("rank*.json"))]
    values = [d.get(METRIC) for d in files if d.get("role") == "drafter"]
    if not values or None in values:
        raise RuntimeError(f"{run_dir}: no {METRIC} in throughput/rank*.json (too few steps for the meter?)")
    return float(sum(values))


def run_train(train_args: list[str], run_dir: Path) -> float:
    """One dflash-train run in `run_dir`; its output goes to RUN_DIR.log. Returns its drafter tokens/s."""
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        rc = common.train(run_dir, train_args, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"dflash-train exited {rc}; its output: {log}")
    return drafter_tokens_per_s(run_dir)


def bootstrap_median_ci(ratios: list[float], level: float = 0.95, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median ratio, resampling pairs with replacement."""
    rng = np.random.default_rng(seed)
    values = np.asarray(ratios)
    medians = np.median(rng.choice(values, size=(resamples, len(values)), replace=True), axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def summary_line(name: str, ratios: list[float]) -> str:
    """Median ratio, spread and bootstrap interval of one comparison, as one line of percentages."""
    lo, hi = bootstrap_median_ci(ratios)
    pct = lambda r: f"{(r - 1) * 100:+.2f}%"   # noqa: E731
    return (f"{name}: median {pct(float(np.median(ratios)))} over {len(ratios)} pairs, "
            f"min..max {pct(min(ratios))} .. {pct(max(ratios))}, 95% CI {pct(lo)} .. {pct(hi)}")


def run_pair(name: str, arms: list[tuple[str, list[str]]], reverse: bool, workdir: Path,
             run: Callable[[list[str], Path], float], keep_runs: bool) -> float:
    """Both arms of one pair, in reverse order when asked; the first arm's rate over the second's."""
    rates = [0.0, 0.0]
    for k in ((1, 0) if reverse else (0, 1)):
        label, args = arms[k]
        run_dir = workdir / f"{name}-{k}-{label}"
        t0_s = time.monotonic()
        rates[k] = run(args, run_dir)
        if not keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"  {name} {label}: {rates[k]:,.1f} tokens/s in {time.monotonic() - t0_s:.1f} s", flush=True)
    print(f"{name}: ratio {rates[0] / rates[1]:.4f}", flush=True)
    return rates[0] / rates[1]


def measure(pairs: int, aa: bool, train_args: list[str], workdir: Path,
            run: Callable[[list[str], Path], float] = run_train, keep_runs: bool = False) -> dict:
    """The ratios per comparison: on/off pairs in ABBA order, each followed by an off/off pair with `aa`."""
    off = [*train_args, "--no-profile"]
    plans = {"on/off": [("on", train_args), ("off", off)], "off/off": [("off", off), ("off", off)]}
    ratios: dict[str, list[float]] = {"on/off": [], "off/off": []} if aa else {"on/off": []}
    for i in range(pairs):
        for name in ratios:
            ratios[name].append(run_pair(f"pair{i}-{name.replace('/', '-')}", plans[name], i % 2 == 1,
                                         workdir, run, keep_runs))
    return ratios


def parse_args(argv: list[str]):
    """This script's options before `--`, dflash-train's after it; a mistake is one line and exit 2."""
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = common.parser(__doc__)
    ap.add_argument("--pairs", type=int, default=6, help="A/B pairs (each two runs)")
    ap.add_argument("--aa", action="store_true", help="also an A/A pair (two --no-profile runs) after each")
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("--keep-runs", action="store_true", help="keep every run directory")
    args = ap.parse_args(argv[:cut])
    args.train = argv[cut + 1:] or list(DEFAULT_TRAIN)
    if args.pairs < 1:
        ap.error(f"--pairs must be at least 1, got {args.pairs}")
    owned = [a for a in args.train if a.split("=")[0] in OWNED_FLAGS]
    if owned:
        ap.error(f"{owned[0]} is set by overhead_ab.py per arm; leave it out of the dflash-train arguments")
    return args


def main(argv: list[str] | None = None) -> int:
    """Parse, run the pairs, print the summaries; exit status 2 on bad arguments, 1 on a failed run."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="overhead_ab-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"dflash-train {' '.join(args.train)}; {METRIC}; runs in {workdir}", flush=True)
    try:
        ratios = measure(args.pairs, args.aa, args.train, workdir, keep_runs=args.keep_runs)
    except RuntimeError as e:
        print(f"overhead_ab: {e}", file=sys.stderr)
        return 1
    for name, values in ratios.items():
        print(summary_line(name if name == "on/off" else "A/A floor (off/off)", values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
