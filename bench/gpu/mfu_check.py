"""The drafter's MFU as a run reports it, against bench/bench_drafter.py's at the same shapes, in one call.

    python3 bench/gpu/mfu_check.py [--out DIR] [--steps 60] [--repeats 8]

The run: dflash-train with a random Qwen3-8B-shaped target cut to 8 layers (bench/make_random_target.py), a
5-layer drafter on K=5 of its layers, 3072-token documents, 6144 tokens a batch, 512 anchors a document, block 16,
the default flex attention and fused loss: bench_drafter's shapes. Its figures: the drafter's steady-state model
FLOP/s and MFU (`dflash-report hotspots --json`, the end-of-run line's window), and the same FLOPs over the
drafter.fwd_bwd span's GPU time in the steady intervals (what bench_drafter times: compute_loss and backward).
The peer, measured in the same call: `bench/bench_drafter.py --backends flex --loss fused` (its FLOPs over its
median step, against the datasheet peak and against its own measured matmul peak). Exits 1 when the run's
fwd_bwd MFU and the benchmark's differ by more than TOLERANCE (relative).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "bench" / "gpu")]

from check import train  # noqa: E402
from profiler import read_records, report  # noqa: E402
from profiler.floors import peak_flops_per_s  # noqa: E402
from profiler.schema.windows import clock_seconds, is_steady  # noqa: E402

TOLERANCE = 0.03
SHAPE_ARGS = ["--max-length", "3072", "--tokens-per-batch", "6144", "--num-anchors", "512", "--block-size", "16",
              "--num-draft-layers", "5", "--num-target-layers", "5", "--eval-prompts", "0"]


def fwd_bwd_rate(run_dir: Path) -> tuple[float | None, int]:
    """(model FLOPs over drafter.fwd_bwd's GPU seconds, summed over the drafter's steady intervals; how many)."""
    flops = seconds = 0.0
    n = 0
    for path in sorted((run_dir / "profile").glob("rank*.jsonl")):
        recs, _ = read_records(path)
        start = next((r for r in recs if r.get("type") == "run_start"), {})
        if start.get("role") != "drafter":
            continue
        phases = start.get("phase_spans") or ()
        for r in recs:
            if r.get("type") != "interval" or not is_steady(r, phases):   # a detail window's spans are a list
                continue
            entry = (r.get("spans") or {}).get("drafter.fwd_bwd")
            if not entry or not entry.get("gpu"):
                continue
            flops += ((r.get("counters") or {}).get("model_flops") or {}).get("total") or 0.0
            seconds += clock_seconds(entry, "gpu")
            n += 1
    return (flops / seconds if seconds > 0 else None), n


def bench(repeats: int) -> dict:
    """bench_drafter.py's JSON (flex attention, the fused loss), measured now on this GPU."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, str(REPO / "bench/bench_drafter.py"), "--backends", "flex", "--loss", "fused",
                        "--no-peer", "--repeats", str(repeats)], check=True, cwd=REPO,
                       env=dict(os.environ, OUT=out, PYTHONPATH=str(REPO)))
        return json.loads((Path(out) / "bench_drafter.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/mfu-check"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=8)
    a = ap.parse_args()
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    target = Path("/tmp/qwen3-8b-shape-8l")
    if not (target / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "bench/make_random_target.py"), "--out", str(target),
                        "--layers", "8"], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    from bench_pipeline import make_long_corpus
    data = root / "long.jsonl"
    make_long_corpus(data, 200, words_per_turn=2048)
    run = root / "mfu-run"
    res = train(run, ["--target-model", str(target), "--data", str(data), *SHAPE_ARGS, "--profile-interval", "5",
                      "--max-steps", str(a.steps)], after_intervals=4)
    print(res["stdout"][-3000:])
    if res["rc"] != 0:
        print(f"the run failed (exit {res['rc']})")
        return 1
    hot = report.hotspots(run)
    drafter = hot["steady"]["roles"]["drafter"]
    rate, intervals = fwd_bwd_rate(run)
    b = bench(a.repeats)
    row = b["rows"][0]
    bench_rate = b["model_flops"] / (row["median_ms"] / 1e3)
    import torch

    sheet = peak_flops_per_s(torch.cuda.get_device_name())
    if sheet is None:
        print(f"{torch.cuda.get_device_name()}: no datasheet peak known; MFU against the measured peak only")
        sheet = (b["peak_flops"], "bench_drafter's measured matmul peak")
    print(f"run, drafter steady state ({drafter['steady_seconds']:.1f} s): model "
          f"{drafter['steady_model_flops_per_s'] / 1e12:.1f} TFLOP/s, MFU {drafter['mfu']}")
    print(f"run, drafter.fwd_bwd GPU time over {intervals} steady intervals: {rate / 1e12:.1f} TFLOP/s, "
          f"{rate / sheet[0]:.2%} of {sheet[1]}")
    print(f"bench_drafter (flex, fused loss, median of {a.repeats}): {bench_rate / 1e12:.1f} TFLOP/s, "
          f"{bench_rate / sheet[0]:.2%} of {sheet[1]}; {bench_rate / b['peak_flops']:.2%} of its measured matmul "
          f"peak {b['peak_flops'] / 1e12:.0f} TFLOP/s")
    gap = rate / bench_rate - 1.0
    print(f"fwd_bwd MFU, run over bench: {gap:+.2%} (tolerance {TOLERANCE:.0%})")
    (root / "mfu_check.json").write_text(json.dumps({"run_steady": drafter, "run_fwd_bwd_flops_per_s": rate,
                                                     "intervals": intervals, "bench": b, "gap": gap}, default=str))
    return 0 if abs(gap) <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
