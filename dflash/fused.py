"""Fused elementwise kernels for the drafter on CUDA: RMSNorm, residual add + RMSNorm, RMSNorm + RoPE
(+ the cast to the attention dtype), and SiLU(gate) * up.

Each is a small pure-tensor function that states the eager math op for op (the `*_math`
functions: Qwen3RMSNorm.forward, the residual add, the drafter's rotate-half RoPE, Qwen3MLP's
act * up), compiled once per process with `torch.compile(dynamic=True)` so that Inductor fuses its
forward into one kernel and its backward into one or two. Dynamic from the first call: the packed
batch changes the row counts every step, and a shape change must not recompile. A new graph is
compiled only for a new dtype, requires_grad pattern or grad mode: a training step compiles six
(rms_norm and add_rms_norm twice each, since layer 0 reads the frozen embedding, which needs no
gradient; qk_norm_rope and silu_mul once), evaluation under no_grad a few more.
tests/dflash/test_fused.py pins that shapes alone never recompile.

Numerics. The compiled graph is traced from the same ops, so it has the same float32 upcast,
float32 variance and rsqrt, the downcast to the input dtype before the weight multiply, and the
same dtype promotion under autocast (float32 weights times bf16 activations give float32). With
`emulate_precision_casts` Inductor also rounds each intermediate to its eager dtype (bf16 products
in RoPE, SiLU's bf16 result before the multiply) instead of keeping it in float32, so results
differ from eager only by float32 reassociation of the mean and fused multiply-adds: within a bf16
ulp for bf16, ~1e-6 relative for float32.

Where. `active(x)` is true for CUDA tensors while `ENABLED` holds; everything else (the CPU,
`ENABLED = False`) runs the eager modules. `ENABLED` is on by default (the drafter step is faster
with it: bench/RESULTS.md). The run's config sets it (`fused_elementwise`, env DFLASH_FUSED_ELEMENTWISE); it is read at every call,
so a benchmark may flip `dflash.fused.ENABLED` between steps (`bench/bench_drafter.py --fused both`
does; bench/gpu/bench_fused.py times the kernels one by one).

Not fused: the k/v concatenation of context and block projections (one copy of [KV, 1024] each,
small next to these) and everything in flex attention and the GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ENABLED = True
"""Use the compiled kernels for CUDA tensors (read at every call; the drafter sets it from the config's
`fused_elementwise`)."""

COMPILE_OPTIONS = {"emulate_precision_casts": True}
"""Inductor options: round intermediates to the dtype eager would hold them in."""


def active(x: torch.Tensor) -> bool:
    """Whether the fused path applies to a tensor: CUDA tensors while ENABLED."""
    return ENABLED and x.is_cuda


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm.forward op for op: float32 variance and rsqrt, downcast, then the weight."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm_math(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(s, rms_norm(s)) with s = x + delta: a residual add and the norm that reads it."""
    s = x + delta
    return s, rms_norm_math(s, weight, eps)


def rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [L, heads, D]; cos/sin: [L, D] (HF rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def qk_norm_rope_math(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, q_eps: float,
                      k_weight: torch.Tensor, k_eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      out_dtype: torch.dtype):
    """The attention's q/k path: per-head RMSNorm, RoPE (queries at the last q.shape[0] positions),
    then the cast to the attention kernels' dtype. q: [Q, heads, D]; k: [KV, kv_heads, D]; cos/sin:
    [KV, D]. One function for both, so cos's row offset (0 for k, KV - Q for q) is never a guard."""
    nq = q.shape[0]
    q = rope_math(rms_norm_math(q, q_weight, q_eps), cos[-nq:], sin[-nq:])
    k = rope_math(rms_norm_math(k, k_weight, k_eps), cos, sin)
    return q.to(out_dtype), k.to(out_dtype)


def silu_mul_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Qwen3MLP's act_fn(gate) * up for act = SiLU."""
    return F.silu(gate) * up


_MATH = {"rms_norm": rms_norm_math, "add_rms_norm": add_rms_norm_math,
         "qk_norm_rope": qk_norm_rope_math, "silu_mul": silu_mul_math}
_compiled: dict = {}


def compiled(name: str):
    """The torch.compile'd `*_math` function `name`, made on first use (dynamic shapes), called
    with autocast off: none of its ops changes dtype under autocast (pow and rsqrt, autocast's
    float32 ops, already see float32), and a graph that does not depend on the autocast state is
    shared by code that runs with and without it."""
    fn = _compiled.get(name)
    if fn is None:
        graph = torch.compile(_MATH[name], dynamic=True, options=COMPILE_OPTIONS)

        def fn(*args):
            with torch.autocast(args[0].device.type, enabled=False):
                return graph(*args)

        _compiled[name] = fn
    return fn


def rms_norm(x, norm):
    """Compiled rms_norm_math with the weight and eps of the RMSNorm module `norm` (dflash.blocks)."""
    return compiled("rms_norm")(x, norm.weight, norm.variance_epsilon)


def add_rms_norm(x, delta, norm):
    """Compiled add_rms_norm_math with `norm`'s weight and eps: (x + delta, norm(x + delta))."""
    return compiled("add_rms_norm")(x, delta, norm.weight, norm.variance_epsilon)


def qk_norm_rope(q, k, q_norm, k_norm, cos, sin, out_dtype):
    """Compiled qk_norm_rope_math with the weights and eps of the RMSNorm modules q_norm, k_norm:
    (q, k) normed, rotated and cast to out_dtype."""
    return compiled("qk_norm_rope")(q, k, q_norm.weight, q_norm.variance_epsilon, k_norm.weight,
                                    k_norm.variance_epsilon, cos, sin, out_dtype)


def silu_mul(gate, up):
    """Compiled silu_mul_math."""
    return compiled("silu_mul")(gate, up)
