"""The real out-of-memory boundary of one training setting on a GPU (issue #50's ground truth), found by bisection
with real runs, beside the memory margin the report forecasts from the smallest run.

    python3 bench/gpu/oom_bisect.py --dimension tokens-per-batch --fits 8192 --ooms 32768 [--steps 30]
                                    [--within 0.10] [--max-runs 5] [--out DIR] [--base FLAG=VALUE ...]
                                    [--extra "FLAGS"]

Each run is dflash-train with bench/gpu/check.py's GPU-bound setting (a random Qwen3-8B-shaped target cut to 8
layers and the drafter sharing one GPU, long documents, the default flex attention), `--max-steps STEPS` (memory
grows over the first tens of steps as packed shapes vary: a short probe misleads), every other setting its
default, and the bisected flag (`--tokens-per-batch`, `--max-length` or `--num-anchors`) set. A run that exits
with an `oom` event (or torch's OutOfMemoryError in its output) ran out; one that finishes its steps fits.
Bisection is geometric between the largest size that fitted and the smallest that ran out, until they are within
`--within` of each other. `--fits` is run first (it must fit: the forecast is made from it).

It prints one row per run (size, outcome, wall time, each rank's peak allocated and reserved, the GPU's NVML peak)
and the table's row: the boundary found (largest fitted, smallest out of memory), the report's `memory_forecast`
from the first run (`dflash-report hotspots --json`: the largest value of the flag, or the setting that caps it)
and its error against the boundary (the goal: within 10%, never above the largest fitted by more than 5%), and the
older whole-run `memory_margin` for tokens per batch. The per-interval allocator history of every run (each rank's
allocated, peak allocated, reserved and peak reserved, NVML used, tokens, step, and its per-step peaks) goes to
OUT/oom_bisect_DIMENSION.json, and the first run's logs cut to what the forecast reads (`trim_logs`: run_start,
each interval's memory) to OUT/fixtures/DIMENSION/profile/: recorded histories for the CPU tests of the forecast.
`--base FLAG=VALUE` changes the base setting (`--base tokens-per-batch=16384` for a --max-length bisection, whose
values a batch caps); `--extra` adds flags to every run (a compile or autotune setting for the transient case).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from profiler.schema import records, views  # noqa: E402

STEP = {"tokens-per-batch": 256, "max-length": 64, "num-anchors": 8}
"""Bisected sizes are multiples of this (the plan's rounding, dflash/memory_watch.py ROUND_TO)."""

FLAGS = {"tokens-per-batch": "--tokens-per-batch", "max-length": "--max-length", "num-anchors": "--num-anchors"}
BASE = {"--max-length": "2048", "--tokens-per-batch": "4096", "--num-anchors": "256"}   # check.py's GPU-bound run
TARGET = Path("/tmp/qwen3-8b-shape-8l")


def setup(root: Path) -> Path:
    """The target (made once) and the long corpus; returns the corpus."""
    if not (TARGET / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "bench/make_random_target.py"), "--out", str(TARGET),
                        "--layers", "8"], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    from bench_pipeline import make_long_corpus
    data = root / "long.jsonl"
    make_long_corpus(data, 400, words_per_turn=4096)
    return data


def history(run: Path) -> dict:
    """{rank: {"role", "intervals": [{step, tokens, allocated, peak_allocated, reserved, peak_reserved,
    nvml_used_peak, nvml_total}]}, "oom": the first oom event's fields or None}."""
    out, oom = {}, None
    for path in sorted((run / "profile").glob("rank*.jsonl")):
        rows, role = [], None
        for rec in map(views.view, records.read_records(path)[0]):
            if isinstance(rec, views.RunStart):
                role = rec.role
            elif isinstance(rec, views.Interval):
                a, gpus = rec.memory.allocator, rec.memory.measured_gpus
                rows.append({"step": rec.step, "tokens": rec.counters.entry("tokens").total,
                             "allocated": a.allocated_bytes, "peak_allocated": a.peak_allocated_bytes,
                             "reserved": a.reserved_bytes, "peak_reserved": a.peak_reserved_bytes,
                             "nvml_used_peak": gpus[0].used_bytes_peak if gpus else None,
                             "nvml_total": gpus[0].total_bytes if gpus else None,
                             "steps": [{"step": r.step, "peak_allocated": r.peak_allocated_bytes,
                                        "allocated": r.allocated_bytes, "sizes": dict(r.sizes)}
                                       for r in (rec.memory.steps.rows if rec.memory.steps else [])]})
            elif isinstance(rec, views.Oom) and oom is None:
                oom = {"rank": path.stem, "step": rec.step, "span": rec.span, "kernel": rec.kernel,
                       "allocated": rec.allocator.allocated_bytes, "reserved": rec.allocator.reserved_bytes}
        out[path.stem] = {"role": role, "intervals": rows}
    return {"ranks": out, "oom": oom}


def trim_logs(run: Path, out: Path) -> Path:
    """The run's logs cut to what the memory forecast reads (run_start whole; each interval's rank, role, index,
    step, warm-up flag, duration and memory; no spans, events or ticks): OUT/profile/rank{R}.jsonl, a fixture the
    forecast gives the same answer for."""
    keep = ("type", "time_unix", "rank", "role", "index", "step", "duration_seconds", "warmup", "memory")
    (out / "profile").mkdir(parents=True, exist_ok=True)
    for path in sorted((run / "profile").glob("rank*.jsonl")):
        lines = []
        for rec in records.read_records(path)[0]:
            if rec.get("type") == records.RUN_START:
                lines.append(rec)
            elif rec.get("type") == records.INTERVAL:
                lines.append({k: rec[k] for k in keep if k in rec} | {"spans": {}, "counters": {}})
        (out / "profile" / path.name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def run_once(root: Path, data: Path, flag: str, size: int, steps: int, base: dict, extra: list) -> dict:
    """One real run at `size`: its outcome, wall time, peaks and history."""
    run = root / f"{flag.strip('-')}-{size}"
    args = dict(base, **{flag: str(size)})
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--target-model", str(TARGET),
                           "--data", str(data), "--eval-prompts", "0", "--profile-interval", "5", "--max-steps",
                           str(steps), "--metrics-port", "0", *[x for kv in args.items() for x in kv], *extra],
                          cwd=REPO, capture_output=True, text=True)
    h = history(run)
    text = done.stdout + done.stderr
    oom = h["oom"] is not None or "OutOfMemoryError" in text or "out of memory" in text.lower()
    last = [r for rank in h["ranks"].values() for r in rank["intervals"]]
    reached = max((r["step"] or 0 for r in last), default=0)
    return {"size": size, "rc": done.returncode, "oom": oom, "fits": done.returncode == 0 and not oom,
            "wall_s": round(time.monotonic() - t0, 1), "last_step": reached, "run_dir": str(run), **h,
            "tail": text[-600:] if done.returncode and not oom else ""}


def peaks(res: dict) -> str:
    parts = []
    for name, rank in res["ranks"].items():
        rows = rank["intervals"]
        pa = max((r["peak_allocated"] or 0 for r in rows), default=0) / 2 ** 30
        pr = max((r["peak_reserved"] or 0 for r in rows), default=0) / 2 ** 30
        parts.append(f"{name} {rank['role']}: peak alloc {pa:.1f} reserved {pr:.1f} GiB")
    nv = max((r["nvml_used_peak"] or 0 for rank in res["ranks"].values() for r in rank["intervals"]), default=0)
    return "; ".join(parts) + f"; NVML peak {nv / 2 ** 30:.1f} GiB"


def margin(run_dir: str) -> dict:
    """The run's `hotspots --json` (its memory_margin and memory_forecast)."""
    done = subprocess.run([sys.executable, "-m", "dflash.report_cli", "hotspots", run_dir, "--json"], cwd=REPO,
                          capture_output=True, text=True)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"reason": done.stderr.strip()[-300:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dimension", choices=sorted(FLAGS), default="tokens-per-batch")
    p.add_argument("--fits", type=int, required=True, help="a size that fits (run first; the forecast's basis)")
    p.add_argument("--ooms", type=int, required=True, help="a size believed to run out (checked)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--within", type=float, default=0.10, help="stop when the bracket is this close (default 10%%)")
    p.add_argument("--max-runs", type=int, default=5)
    p.add_argument("--base", action="append", default=[], metavar="FLAG=VALUE", help="change a base setting")
    p.add_argument("--extra", default="", help="more dflash-train flags for every run, one string")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/oom-bisect")))
    a = p.parse_args(argv)
    if not 0 < a.fits < a.ooms:
        p.error("--fits must be below --ooms")
    base = dict(BASE, **{"--" + k.lstrip("-"): v for k, v in (kv.split("=", 1) for kv in a.base)})
    root = Path("/tmp/oom-bisect-runs") / a.dimension
    root.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    data, flag = setup(root), FLAGS[a.dimension]
    results = []
    save = lambda **more: (a.out / f"oom_bisect_{a.dimension}.json").write_text(json.dumps(   # noqa: E731
        {"dimension": a.dimension, "base": base, "extra": a.extra, "steps": a.steps, "runs": results, **more},
        indent=1))
    lo, hi = bisect(lambda size: run_once(root, data, flag, size, a.steps, base, a.extra.split()), a, results, save)
    report = margin(results[0]["run_dir"]) if results[0]["fits"] else {}
    if results[0]["fits"]:
        trim_logs(Path(results[0]["run_dir"]), a.out / "fixtures" / a.dimension)
    row = table_row(a.dimension, flag, report, lo, hi)
    print(f"\n{a.dimension}: largest that fitted {lo}, smallest out of memory {hi} ({len(results)} runs of "
          f"{a.steps} steps)\n{row['line']}")
    save(largest_fitted=lo, smallest_oom=hi, row=row, memory_forecast=report.get("memory_forecast"),
         memory_margin=report.get("memory_margin"))
    return 0


def bisect(run, a, results: list, save) -> tuple:
    """Run --fits and --ooms, then geometric midpoints until the bracket is within --within: (lo, hi), either None
    where that end was not found (--fits ran out, or --ooms fitted)."""
    lo = hi = None
    for size in (a.fits, a.ooms):
        results.append(run(size))
        print_row(results[-1])
        save()   # after every run: a call cut short keeps what it measured
    lo = a.fits if results[0]["fits"] else None
    hi = a.ooms if not results[1]["fits"] else None
    step = STEP[a.dimension]
    while lo and hi and hi / lo > 1 + a.within and len(results) < a.max_runs:
        size = int(math.sqrt(lo * hi) // step * step)
        if not lo < size < hi:
            break
        results.append(run(size))
        print_row(results[-1])
        lo, hi = (size, hi) if results[-1]["fits"] else (lo, size)
        save()
    if results[1]["fits"]:
        lo = a.ooms   # nothing ran out: the largest tried fitted
    return lo, hi


def table_row(dimension: str, flag: str, report: dict, lo, hi) -> dict:
    """RESULTS.md's row: the forecast from the first run against the boundary found."""
    fc = report.get("memory_forecast") or {}
    st = next((s for s in fc.get("settings") or () if s["flag"] == flag), {})
    largest, cap = st.get("largest"), st.get("capped_by")
    err = (largest / lo - 1) * 100 if largest and lo else None
    if cap and hi is None:
        verdict = f"capped by {cap['flag']} {cap['value']} and no run ran out up to {lo}: agrees"
    elif err is None:
        verdict = f"no figure: {fc.get('reason') or 'no boundary found'}"
    else:
        verdict = ("within 10% and not above by more than 5%" if -10 <= err <= 5 else
                   "ABOVE the boundary by more than 5%" if err > 5 else "more than 10% below the boundary")
    margin_ = report.get("memory_margin") or {}
    old = margin_.get("max_tokens_per_batch") if dimension == "tokens-per-batch" else None
    line = (f"| {flag} | forecast {largest} ({'capped' if cap else 'memory'}) | boundary: fitted {lo}, OOM {hi} | "
            f"error {'n/a' if err is None else f'{err:+.1f}%'} | {verdict} |"
            + (f" whole-run margin {old}" if old else ""))
    return {"flag": flag, "forecast": largest, "capped_by": cap, "largest_fitted": lo, "smallest_oom": hi,
            "error_pct": err, "verdict": verdict, "line": line,
            "transient": st.get("transient"), "basis": st.get("basis")}


def print_row(res: dict) -> None:
    outcome = "fits" if res["fits"] else ("OOM" if res["oom"] else f"FAILED rc {res['rc']}")
    where = f" at {res['oom']}" if res["oom"] and res.get("oom") else ""
    print(f"{res['size']:>7} {outcome:<6} {res['wall_s']:6.1f} s  last step {res['last_step']}{where}  {peaks(res)}"
          + (f"\n    {res['tail']}" if res["tail"] else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
