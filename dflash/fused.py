"""Fused elementwise kernels for the drafter on CUDA: RMSNorm, residual add + RMSNorm, RMSNorm + RoPE
(+ the cast to the attention dtype), and SiLU(gate) * up.

Each `*_math` function is the eager math op for op, compiled once per process with dynamic shapes (the
packed batch changes row counts every step, which must not recompile); Inductor rounds intermediates
to their eager dtype, so results differ from eager only by float32 reassociation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COMPILE_OPTIONS = {"emulate_precision_casts": True}
"""Inductor options: round intermediates to the dtype eager would hold them in."""


def active(x: torch.Tensor) -> bool:
    """Whether the compiled kernels serve `x` (a CUDA tensor), for a caller built with them on
    (dflash.model's `fused_elementwise`)."""
    return x.is_cuda


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm.forward op for op: float32 variance and rsqrt, downcast, then the weight."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def add_rms_norm_math(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(s, rms_norm(s)) with s = x + delta."""
    s = x + delta
    return s, rms_norm_math(s, weight, eps)


def rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [L, heads, D]; cos/sin: [L, D] (HF rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def qk_norm_rope_math(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, q_eps: float,
                      k_weight: torch.Tensor, k_eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      out_dtype: torch.dtype):
    """Per-head RMSNorm, RoPE (queries at the last Q positions of cos/sin [KV, D]) and the cast to the
    attention dtype; one function for q and k, so cos's row offset is never a guard."""
    nq = q.shape[0]
    q = rope_math(rms_norm_math(q, q_weight, q_eps), cos[-nq:], sin[-nq:])
    k = rope_math(rms_norm_math(k, k_weight, k_eps), cos, sin)
    return q.to(out_dtype), k.to(out_dtype)


def silu_mul_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_MATH = {"rms_norm": rms_norm_math, "add_rms_norm": add_rms_norm_math,
         "qk_norm_rope": qk_norm_rope_math, "silu_mul": silu_mul_math}
_compiled: dict = {}


def compiled(name: str):
    """The torch.compile'd `*_math` function `name`, called with autocast off (none of its ops changes
    dtype under autocast), so one graph serves code with and without it."""
    fn = _compiled.get(name)
    if fn is None:
        graph = torch.compile(_MATH[name], dynamic=True, options=COMPILE_OPTIONS)

        def fn(*args):
            with torch.autocast(args[0].device.type, enabled=False):
                return graph(*args)

        _compiled[name] = fn
    return fn


def rms_norm(x, norm):
    return compiled("rms_norm")(x, norm.weight, norm.variance_epsilon)


def add_rms_norm(x, delta, norm):
    return compiled("add_rms_norm")(x, delta, norm.weight, norm.variance_epsilon)


def qk_norm_rope(q, k, q_norm, k_norm, cos, sin, out_dtype):
    return compiled("qk_norm_rope")(q, k, q_norm.weight, q_norm.variance_epsilon, k_norm.weight,
                                    k_norm.variance_epsilon, cos, sin, out_dtype)


def silu_mul(gate, up):
    return compiled("silu_mul")(gate, up)
