"""What a Kineto capture costs, and what reading it costs: the Qwen3-8B-shaped drafter step (bench_drafter.py's
shapes) under our profiler, a capture of K steps asked through the capture API in the middle of the run.

    python3 bench/bench_capture.py [--steps 24] [--at 12] [--capture-steps 3] [--tiny]

Each step is `drafter.fwd_bwd` (compute_loss + backward) and `drafter.optim` spans, timed between two device
syncs (this script's own, for step times; the trainer has none). Prints the median step time of the steps
before the capture (after warm-up), the step before it (Kineto's warm-up), the captured steps, and the steps
after, with each one's ratio to the steps before; the trace's size (total and a step); the capture's own cost at
its boundaries (`begin_seconds`, `stop_seconds`); and how long `dflash-report kernels` (report.kernels, in this
process) takes to read the capture, with the number of GPU events in it. `--tiny`: tiny shapes, CPU, dense
attention (a smoke test: its timings mean nothing). Writes bench_capture.json under $OUT when set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

import profiler  # noqa: E402
from bench_drafter import QWEN3_8B, TINY, build_model, make_batch, sync  # noqa: E402
from dflash.loss import compute_loss  # noqa: E402
from profiler.config import ProfilerConfig  # noqa: E402


def run(args, device, run_dir: Path) -> dict:
    shape = TINY if args.tiny else QWEN3_8B
    model = build_model("dense" if args.tiny else "flex", device, shape)
    packed = make_batch(device, shape)
    ctx = packed.context(0.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    cfg = ProfilerConfig(interval_s=3600.0, detail_steps=0, control=False)
    times_s = []
    with profiler.Profiler(run_dir, device=device, config=cfg) as prof:
        for step in range(args.steps):
            if step == 1:   # armed through the endpoint's own entry point, as `dflash-profile capture` does
                reply = prof.captures.request({"at_step": args.at, "steps": args.capture_steps})
                assert reply["ok"], reply
            sync(device)
            t0 = time.perf_counter()
            profiler.set_step(step)   # a capture begins, moves on or stops here
            with profiler.span("drafter.fwd_bwd"):
                out = compute_loss(model, packed, ctx, shape.anchors, 7.0, torch.Generator().manual_seed(step))
                out.loss.backward()
            with profiler.span("drafter.optim"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            sync(device)
            times_s.append(time.perf_counter() - t0)
    return {"times_s": times_s}


def summarise(times_s: list, at: int, k: int, warm: int) -> dict:
    """Median step time of each phase around the capture (the boundary steps hold its begin and stop)."""
    phases = {"before": times_s[warm:at - 1], "warm-up step (begin)": times_s[at - 1:at],
              "captured": times_s[at:at + k], "first after (stop, export)": times_s[at + k:at + k + 1],
              "after": times_s[at + k + 1:]}
    base = statistics.median(phases["before"])
    return {name: {"steps": len(v), "median_ms": 1e3 * statistics.median(v), "ratio": statistics.median(v) / base}
            for name, v in phases.items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--at", type=int, default=12)
    ap.add_argument("--capture-steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of `before` (compilation)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    if not args.warmup + 2 <= args.at < args.at + args.capture_steps + 2 <= args.steps:
        print("bench_capture: need warmup + 2 <= at and at + capture-steps + 2 <= steps", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    run_dir = Path(tempfile.mkdtemp(prefix="bench_capture_", dir=os.environ.get("OUT") or None))
    times = run(args, device, run_dir)["times_s"]
    from profiler.schema.records import read_records
    from profiler.report.kernels import kernels
    event = next(r for r in read_records(run_dir / "profile" / "rank0.jsonl")[0] if r.get("kind") == "capture")
    t0 = time.perf_counter()
    rep = kernels(run_dir, args.at)
    read_s = time.perf_counter() - t0
    spans = rep["ranks"][0]["spans"]
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": "tiny" if args.tiny
           else "qwen3-8b drafter", "phases": summarise(times, args.at, args.capture_steps, args.warmup),
           "trace_bytes": event.get("bytes"), "bytes_per_step": event.get("bytes_per_step"),
           "begin_seconds": event.get("begin_seconds"), "stop_seconds": event.get("stop_seconds"),
           "report_kernels_seconds": read_s, "gpu_kernels": sum(s["kernels_total"]["count"] for s in spans),
           "spans": {s["name"]: {"our_gpu_ms": None if s["our_gpu_window_seconds"] is None else
                                 1e3 * s["our_gpu_window_seconds"], "busy_share": s["busy_share"]} for s in spans}}
    print(f"{out['shape']} on {out['device']}: {args.steps} steps, capture of steps {args.at}-"
          f"{args.at + args.capture_steps - 1}")
    for name, p in out["phases"].items():
        print(f"  {name:<28} {p['steps']:>3} steps  median {p['median_ms']:9.2f} ms  x{p['ratio']:.3f} of before")
    print(f"  trace {out['trace_bytes'] / 1e6:.2f} MB gzip'd ({out['bytes_per_step'] / 1e6:.2f} MB a step); begin "
          f"{out['begin_seconds']:.3f} s, stop+export {out['stop_seconds']:.3f} s; report.kernels read it in "
          f"{read_s:.2f} s ({out['gpu_kernels']} kernels)")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_capture.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
