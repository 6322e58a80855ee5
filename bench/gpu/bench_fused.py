"""dflash.fused kernel by kernel at the Qwen3-8B bench shapes (bf16, 16,384 query rows, 22,528 keys,
hidden 4096, 32/8 heads of 128, intermediate 12288): forward + backward time of the eager code
against the compiled kernel, the activation memory each keeps for backward, and the first call's
seconds (trace + Inductor + Triton compile, or cache loads when TORCHINDUCTOR_CACHE_DIR already
holds them). Run on a CUDA host from the repo root:

    PYTHONPATH=. python3 bench/gpu/bench_fused.py [--repeats 20] [--variants module,rows]

`--variants`: `module` is dflash.fused as the drafter calls it (torch.compile(dynamic=True));
`rows` compiles the same math with only the row dims dynamic (head count and widths static), to
see what static widths buy the generated kernels. The whole-step A/B is
`bench/bench_drafter.py --fused both`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from dflash import fused

Q, NK, H, HEADS, KV_HEADS, D, INTER = 16384, 22528, 4096, 32, 8, 128, 12288
"""Query rows (1,024 blocks of 16), keys (6,144 context + the query rows), widths."""


def _param(n: int) -> nn.Parameter:
    return nn.Parameter(1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16))


def _act(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True)


def cases() -> dict:
    """name -> args of the fused function, as the bench drafter passes them."""
    pos = torch.arange(NK, device="cuda", dtype=torch.float32)[:, None]
    angle = pos * 1e6 ** (-torch.arange(D // 2, device="cuda") / (D // 2))
    angle = torch.cat([angle, angle], -1)
    return {
        "rms_norm": (_act(Q, H), _param(H), 1e-6),
        "add_rms_norm": (_act(Q, H), _act(Q, H), _param(H), 1e-6),
        "qk_norm_rope": (_act(Q, HEADS, D), _act(NK, KV_HEADS, D), _param(D), 1e-6, _param(D), 1e-6,
                         angle.cos().bfloat16(), angle.sin().bfloat16(), torch.bfloat16),
        "silu_mul": (_act(Q, INTER), _act(Q, INTER)),
    }


def rows_dynamic(name: str):
    """The same math compiled with dim 0 of every input tensor dynamic and all else static."""
    graph = torch.compile(fused._MATH[name], options=fused.COMPILE_OPTIONS)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        with torch.autocast("cuda", enabled=False):
            return graph(*args)

    return call


def fwd_bwd(fn, args, cot):
    """One forward + backward (input gradients returned, not accumulated); returns the bytes
    allocated while the forward's graph was alive: outputs plus what it saved for backward."""
    base = torch.cuda.memory_allocated()
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    held = torch.cuda.memory_allocated() - base
    torch.autograd.grad(outs, [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad], cot)
    return held


def measure(name: str, fn, args, repeats: int) -> dict:
    """First call's seconds, then median ms of fwd+bwd and the activation bytes kept for backward."""
    with torch.no_grad():
        outs = fused._MATH[name](*args)
    cot = [torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,))]
    del outs
    torch.cuda.synchronize()  # deliberate: benchmark boundary
    t0 = time.perf_counter()
    held = fwd_bwd(fn, args, cot)
    torch.cuda.synchronize()  # deliberate: benchmark boundary
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fwd_bwd(fn, args, cot)
        end.record()
        end.synchronize()  # deliberate: benchmark timing
        times.append(start.elapsed_time(end))
    return {"first_s": first_s, "ms": statistics.median(times), "held_mib": held / 2 ** 20}


def main(argv=None) -> int:
    """Print one row per (function, variant)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="module", help="comma-separated: module, rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"{'function':<14}{'variant':>8}{'fwd+bwd ms':>12}{'held MiB':>10}{'first s':>9}")
    for name, fargs in cases().items():
        fns = {"eager": fused._MATH[name]}
        for v in args.variants.split(","):
            fns[v] = fused.compiled(name) if v == "module" else rows_dynamic(name)
        for variant, fn in fns.items():
            r = measure(name, fn, fargs, args.repeats)
            print(f"{name:<14}{variant:>8}{r['ms']:>12.3f}{r['held_mib']:>10.0f}{r['first_s']:>9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
