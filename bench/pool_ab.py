"""Pool the paired on/off runs of several in-run A/B files (bench/ab_inrun.py's --json output, e.g. one per
device call) into one estimate, so a claim about row 2 of issue #14 that rests on several runs is a command,
not arithmetic by hand:

    python3 bench/pool_ab.py [--part all] [--workload launch] FILE.json [FILE.json ...]

Every run of every file whose part and workload match (and that injected nothing) is one stratum: its
per-pair ratios (the file keeps them) pooled by inverse variance (profiler/abstats.py `pooled_stats`).
Prints a table, one row per run and the pooled row, with the same "resolves 1%" / "within 1%" verdicts as
each run's, and Cochran's Q and I^2 (how far the runs disagree beyond their own spread). Exit 2 on a file
that is not such a JSON or holds no matching run."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profiler.abstats import paired_stats, pooled_stats, verdicts   # noqa: E402


def matching_runs(path: Path, part: str, workload: str) -> list[dict]:
    """The runs of one ab_inrun JSON with that part and workload, no injected cost, and pairs recorded."""
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"pool_ab: {path}: cannot read it as an ab_inrun JSON ({type(e).__name__}: {e})") from None
    out = []
    for run in runs:
        result = run.get("result") or {}
        ratios = (result.get("paired") or {}).get("ratios") or []
        if (run.get("part") == part and run.get("workload") == workload and not run.get("inject_s")
                and len(ratios) > 1):
            if not all(type(r) in (int, float) and 0 < r < math.inf for r in ratios):
                raise ValueError(f"pool_ab: {path}: run {run.get('run_dir', '?')}: a ratio that is not a positive "
                                 "finite number")
            out.append({"file": path.name, "run_dir": run.get("run_dir", "?"), "ratios": ratios,
                        "off": (result.get("off") or {}).get("mean")})
    return out


def row(label: str, stats: dict, off) -> str:
    v = verdicts(stats)
    off_text = f"{off:.2f}" if isinstance(off, (int, float)) else "-"
    return (f"| {label} | {stats['n']} | {off_text} | {stats['mean_diff_pct']:+.2f}% | {stats['ci_low_pct']:+.2f} .. "
            f"{stats['ci_high_pct']:+.2f}% | {stats['half_width_pct']:.2f}% | {'yes' if v['resolves'] else 'no'} | "
            f"{v['within']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pool in-run on/off A/B runs (bench/ab_inrun.py JSON files).")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--part", default="all", help="which part's runs (default all: the whole profiler)")
    ap.add_argument("--workload", default="launch")
    a = ap.parse_args(argv)
    try:
        runs = [r for f in a.files for r in matching_runs(f, a.part, a.workload)]
        if not runs:
            raise ValueError(f"pool_ab: no {a.workload} run of part {a.part} without injected cost in "
                             f"{len(a.files)} file(s)")
        pooled = pooled_stats([r["ratios"] for r in runs])
    except ValueError as e:   # everything checked before the table starts
        print(str(e) if str(e).startswith("pool_ab:") else f"pool_ab: {e}", file=sys.stderr)
        return 2
    print("| run | pairs | off steps/s | on vs off | 95% CI | half-width | resolves 1% | on within 1% |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        alone = paired_stats(r["ratios"], [1.0] * len(r["ratios"]))   # the run's own interval, from its ratios
        print(row(f"{r['file']}: {Path(r['run_dir']).parent.name}", alone, r["off"]))
    print(row(f"**pooled, {pooled['runs']} runs**", pooled, None))
    print(f"Cochran's Q {pooled['q']:.2f} on {pooled['runs'] - 1} df; I^2 {100 * pooled['i2']:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
