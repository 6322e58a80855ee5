"""The real out-of-memory boundary of one training setting on a GPU (issue #50's ground truth), found by bisection
with real runs, beside the memory margin the report forecasts from the smallest run.

    python3 bench/gpu/oom_bisect.py --dimension tokens-per-batch --fits 8192 --ooms 32768 [--steps 30]
                                    [--within 0.10] [--max-runs 5] [--out DIR]

Each run is dflash-train with bench/gpu/check.py's GPU-bound setting (a random Qwen3-8B-shaped target cut to 8
layers and the drafter sharing one GPU, long documents, the default flex attention), `--max-steps STEPS` (memory
grows over the first tens of steps as packed shapes vary: a short probe misleads), every other setting its
default, and the bisected flag (`--tokens-per-batch`, `--max-length` or `--num-anchors`) set. A run that exits
with an `oom` event (or torch's OutOfMemoryError in its output) ran out; one that finishes its steps fits.
Bisection is geometric between the largest size that fitted and the smallest that ran out, until they are within
`--within` of each other. `--fits` is run first (it must fit: the forecast is made from it).

It prints one row per run (size, outcome, wall time, each rank's peak allocated and reserved, the GPU's NVML peak)
and the table: the boundary found (largest fitted, smallest out of memory), the report's `memory_margin` from the
first run (`dflash-report hotspots --json`) and its error against the boundary. The per-interval allocator history
of every run (each rank's allocated, peak allocated, reserved and peak reserved, NVML used, tokens, step) goes to
OUT/oom_bisect_DIMENSION.json: recorded histories for CPU tests of a forecast.
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
                             "nvml_total": gpus[0].total_bytes if gpus else None})
            elif isinstance(rec, views.Oom) and oom is None:
                oom = {"rank": path.stem, "step": rec.step, "span": rec.span, "kernel": rec.kernel,
                       "allocated": rec.allocator.allocated_bytes, "reserved": rec.allocator.reserved_bytes}
        out[path.stem] = {"role": role, "intervals": rows}
    return {"ranks": out, "oom": oom}


def run_once(root: Path, data: Path, flag: str, size: int, steps: int) -> dict:
    """One real run at `size`: its outcome, wall time, peaks and history."""
    run = root / f"{flag.strip('-')}-{size}"
    args = dict(BASE, **{flag: str(size)})
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--target-model", str(TARGET),
                           "--data", str(data), "--eval-prompts", "0", "--profile-interval", "5", "--max-steps",
                           str(steps), "--metrics-port", "0", *[x for kv in args.items() for x in kv]],
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
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/oom-bisect")))
    a = p.parse_args(argv)
    if not 0 < a.fits < a.ooms:
        p.error("--fits must be below --ooms")
    root = Path("/tmp/oom-bisect-runs")
    root.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    data, flag = setup(root), FLAGS[a.dimension]
    results, lo, hi = [], None, None
    save = lambda **more: (a.out / f"oom_bisect_{a.dimension}.json").write_text(json.dumps(   # noqa: E731
        {"dimension": a.dimension, "base": BASE, "steps": a.steps, "runs": results, **more}, indent=1))
    for size in [a.fits, a.ooms]:
        results.append(run_once(root, data, flag, size, a.steps))
        print_row(results[-1])
        save()   # after every run: a call cut short keeps what it measured
    if results[0]["fits"]:
        lo = a.fits
    if not results[1]["fits"]:
        hi = a.ooms
    while lo and hi and hi / lo > 1 + a.within and len(results) < a.max_runs:
        size = int(math.sqrt(lo * hi) // 256 * 256)
        results.append(run_once(root, data, flag, size, a.steps))
        print_row(results[-1])
        lo, hi = (size, hi) if results[-1]["fits"] else (lo, size)
        save()
    report = margin(results[0]["run_dir"]) if results[0]["fits"] else {}
    forecast = report.get("memory_margin") or {}
    predicted = forecast.get("max_tokens_per_batch") if a.dimension == "tokens-per-batch" else None
    new = next((s for s in (report.get("memory_forecast") or {}).get("settings", []) if s["flag"] == flag), {})
    print(f"memory_forecast from the {a.fits} run: {new.get('largest')} "
          f"({(new['largest'] / lo - 1) * 100:+.1f}% against the largest fitted)" if new.get("largest") and lo else
          f"memory_forecast: {(report.get('memory_forecast') or {}).get('reason')}; {new}")
    print(f"\n{a.dimension}: largest that fitted {lo}, smallest out of memory {hi} ({len(results)} runs of "
          f"{a.steps} steps)")
    err = f"{(predicted / lo - 1) * 100:+.1f}% against the largest fitted" if predicted and lo else "n/a"
    print(f"the report's memory_margin from the {a.fits} run: {predicted} ({err}); "
          f"basis: {forecast.get('reason') or forecast.get('growth')}")
    save(largest_fitted=lo, smallest_oom=hi, memory_margin=forecast, memory_forecast=report.get("memory_forecast"))
    return 0


def print_row(res: dict) -> None:
    outcome = "fits" if res["fits"] else ("OOM" if res["oom"] else f"FAILED rc {res['rc']}")
    where = f" at {res['oom']}" if res["oom"] and res.get("oom") else ""
    print(f"{res['size']:>7} {outcome:<6} {res['wall_s']:6.1f} s  last step {res['last_step']}{where}  {peaks(res)}"
          + (f"\n    {res['tail']}" if res["tail"] else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
