"""A span's GPU window (its two CUDA events) against torch.profiler's (Kineto) view of the same steps.

    python3 bench/gpu/window_check.py [--steps 20] [--out DIR]

Three spans run each step under our profiler and, inside each, a `record_function` of the same name, all
inside one torch.profiler capture (CPU and CUDA activities):
  bench.matmul   8 bf16 matmuls 8192^3 (compute-bound, ~10 ms)
  bench.copy     one 4 GiB device-to-device copy (memory-bound, ~2 ms)
  bench.launch   2000 tiny kernels (launch-bound: the stream idles between them, ~4 ms)
For every span instance it prints our GPU window (end event - start event), Kineto's window for the
same range (its `gpu_user_annotation`: first kernel start to last kernel end) and Kineto's busy time
(the union of the kernels inside), then per span the median window ratio ours/Kineto's and busy/window.
Each span is measured twice: after a GPU-bound span (the stream busy when it begins, so its start event
runs as its first kernel is due) and after the launch-bound one (the stream idle: our window then also
holds the idle lead-in until the host has launched the first kernel, which Kineto's range does not).
The peer is Kineto in the same run; nothing is typed in. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
from pathlib import Path

import torch

import profiler
from profiler.config import ProfilerConfig


def workloads(device):
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.empty(1 << 31, device=device, dtype=torch.float16)   # 4 GiB
    dst = torch.empty_like(src)
    tiny = torch.zeros(16, device=device)

    def matmul():
        for _ in range(8):
            torch.mm(a, b)

    def copy():
        dst.copy_(src)

    def launch():
        for _ in range(2000):
            tiny.add_(1.0)
    return {"bench.matmul": matmul, "bench.copy": copy, "bench.launch": launch}


ORDERS = {"matmul after copy": ("bench.copy", "bench.matmul", "bench.launch"),
          "matmul after launch": ("bench.launch", "bench.matmul", "bench.copy", "bench.launch", "bench.copy")}
"""Per step, both sequences: matmul and copy follow a GPU-bound span (`.busy`) and the launch-bound span
(`.idle`); the launch-bound span follows both too."""


def kineto_ranges(trace: dict, names) -> dict:
    """{name: [(window_us, busy_us)]} in time order: each gpu_user_annotation range of a span name, with the
    union of the kernels/memcpys/memsets that start inside it."""
    events = trace.get("traceEvents", [])
    ranges = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name") in names),
                    key=lambda e: e["ts"])
    work = sorted(((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda w: w[0])
    out: dict = {n: [] for n in names}
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r.get("dur", 0)
        inside = [(max(s, lo), min(e, hi)) for s, e in work if lo <= s < hi]
        busy, end = 0.0, lo
        for s, e in inside:               # union of the intervals (they are sorted by start)
            if e > end:
                busy += e - max(s, end)
                end = e
        out[r["name"]].append((r.get("dur", 0), busy))
    return out


def our_windows(run_dir: Path, names) -> dict:
    """{name: [gpu_seconds]} in time order from the run's `spans` records."""
    recs, _ = profiler.read_records(run_dir / "profile" / "rank0.jsonl")
    spans = sorted((s for r in recs if r.get("type") == "spans" for s in r["spans"] if s["name"] in names),
                   key=lambda s: s["start_unix_ns"])
    out: dict = {n: [] for n in names}
    for s in spans:
        out[s["name"]].append(s["gpu_seconds"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda")
    work = workloads(device)
    run_dir = Path(a.out or tempfile.mkdtemp(prefix="gpu-window-"))
    cfg = ProfilerConfig(interval_s=3600.0, detail_steps=a.steps + 5, control=False, measure_floors=False)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with profiler.Profiler(run_dir, device=device, config=cfg) as prof:
        for name, fn in work.items():   # warm-up: kernels loaded, allocator settled
            fn()
        torch.cuda.synchronize()   # deliberate: the capture starts on an idle GPU
        before = "bench.launch"
        with torch.profiler.profile(activities=acts) as kp:
            for step in range(a.steps):
                profiler.set_step(step)
                for names in ORDERS.values():
                    for name in names:   # named by what ran before it: a GPU-bound span, or the launch-bound one
                        tagged = f"{name}.{'idle' if before == 'bench.launch' else 'busy'}"
                        with profiler.span(tagged), torch.profiler.record_function(tagged):
                            work[name]()
                        before = name
            torch.cuda.synchronize()   # deliberate: every event and kernel done before the export
        prof.close_interval()
    trace_path = run_dir / "kineto.json"
    kp.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    with gzip.open(run_dir / "kineto.json.gz", "wt") as f:
        json.dump(trace, f)
    trace_path.unlink()
    names = [f"{n}.{k}" for n in work for k in ("busy", "idle")]   # every name occurs in the steps above
    report(our_windows(run_dir, names), kineto_ranges(trace, names), a.steps)


def report(ours: dict, kineto: dict, steps: int) -> None:
    print(f"GPU window per span: ours (CUDA events) vs Kineto (gpu_user_annotation), {steps} steps, same run")
    print(f"{'span (before it)':<20} {'n':>4} {'ours ms':>9} {'kineto ms':>10} {'ratio':>8} {'max |dev|':>9} {'busy/window':>12}")
    for name in ours:
        pairs = list(zip(ours[name], kineto[name]))
        if not pairs or len(ours[name]) != len(kineto[name]):
            print(f"{name:<20} unmatched: ours {len(ours[name])}, kineto {len(kineto[name])}")
            if not pairs:
                continue
        ratios = [o / (k[0] / 1e6) for o, k in pairs if o and k[0] > 0]
        busy = [k[1] / k[0] for _, k in pairs if k[0] > 0]
        print(f"{name:<20} {len(pairs):>4} {1e3 * statistics.median(o for o, _ in pairs):>9.3f} "
              f"{statistics.median(k[0] for _, k in pairs) / 1e3:>10.3f} {statistics.median(ratios):>8.4f} "
              f"{max(abs(r - 1) for r in ratios):>9.4f} {statistics.median(busy):>12.3f}")


if __name__ == "__main__":
    main()
