"""Where the bench drafter step's GPU time goes: torch.profiler over 2 steps of bench_drafter.py's
flex step at Qwen3-8B shapes, after warm-up, printing the top kernels by CUDA time and the share of
a few families (GEMM, flex attention, everything else). Run on a CUDA host from the repo root:

    PYTHONPATH=.:bench python3 bench/gpu/profile_drafter.py
"""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import bench_drafter as bd
from dflash.loss import compute_loss


def step(model, packed, ctx):
    out = compute_loss(model, packed, ctx, bd.ANCHORS, 7.0, torch.Generator().manual_seed(0))
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def family(name: str) -> str:
    """A coarse kernel family from the kernel's name."""
    n = name.lower()
    if "gemm" in n or "cutlass" in n or "sm90" in n or "matmul" in n or "nvjet" in n:
        return "gemm"
    if "flex" in n or "triton_tem" in n:
        return "flex attention"
    if "softmax" in n or "nll" in n or "cross_entropy" in n or "logsumexp" in n:
        return "softmax/CE"
    return "other"


def main() -> int:
    device = torch.device("cuda")
    packed = bd.make_batch(device)
    model = bd.build_model("flex", device)
    ctx = packed.context(0.0)
    for _ in range(3):
        step(model, packed, ctx)
    torch.cuda.synchronize()   # deliberate: benchmark boundary
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(model, packed, ctx)
        torch.cuda.synchronize()   # deliberate: benchmark boundary
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total_us = sum(e.device_time_total for e in events)
    fam: dict = {}
    for e in events:
        fam[family(e.key)] = fam.get(family(e.key), 0.0) + e.device_time_total
    print(f"GPU time over 2 steps: {total_us / 1e3:.1f} ms ({total_us / 2e3:.1f} ms/step)")
    for k, v in sorted(fam.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<16} {v / 2e3:8.1f} ms/step {v / total_us:6.1%}")
    print(f"{'kernel':<90} {'ms/step':>8} {'calls':>6}")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:30]:
        print(f"{e.key[:90]:<90} {e.device_time_total / 2e3:8.2f} {e.count // 2:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
