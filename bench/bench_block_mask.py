"""The drafter's BlockMask two ways: read off the layout's tables (`tile_block_mask`, what the trainer
does for a block size that divides the 128-row tile) against torch's compiled `create_block_mask` (what
it did before, the peer here), on the same layouts.

    python3 bench/bench_block_mask.py [--repeats 200] [--device cuda|cpu]

Layouts: `bench` is bench_drafter's batch (2 documents x 3072 tokens, 512 anchors each, block 16) and
`tiny` a tiny-target batch (2 x 256 tokens, 32 anchors each), each with no window and a 1024-position
one. For each it checks that both give the same tensors (every one of the eight), then prints, per way:
the first call (for create_block_mask that is its dynamo trace and inductor compile, from this process's
caches), and per later call the host's thread CPU and wall time, and the GPU time (CUDA events around
`repeats` back-to-back calls). Writes bench_block_mask.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.attention import build_layout, compiled, make_mask_mod, tile_block_mask   # noqa: E402

LAYOUTS = {"bench": (2, 3072, 512), "tiny": (2, 256, 32)}
"""name -> (documents, tokens per document, anchors per document)."""
WINDOWS = (None, 1024)
TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
           "q_indices", "full_q_num_blocks", "full_q_indices")


def make_layout(docs: int, tokens: int, anchors: int, device, block_size: int = 16, seed: int = 0):
    """`docs` documents of `tokens` each, `anchors` sorted anchors per document (not its first token)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.arange(docs).repeat_interleave(tokens).to(torch.int32)
    pos = torch.arange(tokens).repeat(docs)
    picks = [d * tokens + 1 + torch.sort(torch.randperm(tokens - block_size, generator=g)[:anchors]).values
             for d in range(docs)]
    a = torch.cat(picks)
    return build_layout(*(t.to(device) for t in (doc, pos, doc[a], a, pos[a])), block_size)


def time_way(build, repeats: int, device) -> dict:
    """First call's wall seconds, then per-call host CPU / wall microseconds and GPU microseconds."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()                                  # deliberate: bench boundaries only
    t0 = time.perf_counter()
    first = build()
    sync()
    first_s = time.perf_counter() - t0
    cpu, wall = [], []
    for _ in range(5):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(repeats // 5):
            build()
        cpu.append((time.thread_time_ns() - c0) / (repeats // 5) / 1e3)
        wall.append((time.perf_counter_ns() - w0) / (repeats // 5) / 1e3)
        sync()
    gpu_us = None
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(repeats):
            build()
        e1.record()
        e1.synchronize()                    # deliberate: bench
        gpu_us = e0.elapsed_time(e1) * 1e3 / repeats
    return {"mask": first, "first_s": first_s, "cpu_us": statistics.median(cpu),
            "wall_us": statistics.median(wall), "gpu_us": gpu_us}


def run(device, repeats: int) -> list:
    from torch.nn.attention.flex_attention import create_block_mask

    peer = compiled(create_block_mask) if device.type == "cuda" else create_block_mask
    rows = []
    for name, shape in LAYOUTS.items():
        lay = make_layout(*shape, device)
        for window in WINDOWS:
            mod = make_mask_mod(lay, window)
            q, kv = lay.num_queries, lay.kv_doc.shape[0]
            ways = {"tables": time_way(lambda: tile_block_mask(lay, window, mod), repeats, device),
                    "create_block_mask": time_way(lambda: peer(mod, None, None, q, kv, device=device),
                                                  repeats, device)}
            a, b = ways["tables"].pop("mask"), ways["create_block_mask"].pop("mask")
            same = all(torch.equal(getattr(a, t), getattr(b, t)) for t in TENSORS)
            rows.append({"layout": name, "window": window, "q": q, "kv": kv, "same": same, **{
                f"{way}_{k}": v for way, r in ways.items() for k, v in r.items()}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error(f"--repeats: at least 5 (five timed rounds), got {args.repeats}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device: cuda asked for, but torch sees no CUDA device")
    rows = run(device, args.repeats)
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print(f"{'layout':<6} {'window':>6} {'Q x KV':>13} {'same':>5} | {'way':<17} {'first s':>8} "
          f"{'cpu us':>8} {'wall us':>8} {'gpu us':>8}")
    for r in rows:
        for way in ("tables", "create_block_mask"):
            gpu = r[f"{way}_gpu_us"]
            print(f"{r['layout']:<6} {str(r['window']):>6} {r['q']:>6}x{r['kv']:<6} {str(r['same']):>5} | "
                  f"{way:<17} {r[f'{way}_first_s']:>8.3f} {r[f'{way}_cpu_us']:>8.1f} {r[f'{way}_wall_us']:>8.1f} "
                  f"{'-' if gpu is None else f'{gpu:.1f}':>8}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_block_mask.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
