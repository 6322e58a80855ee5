"""A tensor's numerics statistics in one pass on a CUDA GPU (Triton): the row `profiler.nonfinite.tensor_stats`
makes with eight torch reductions (|x|, three compares and sums, an amax, a norm: each a pass over the tensor, two
of them writing a tensor as large), here read once. Each program strides over blocks of the tensor, keeps its
partial largest |x|, sum of squares (float32) and three counts in registers, and folds them into the row with one
atomic per statistic; the norm is the square root of the sum (one more tiny kernel). No host sync.

Layouts read in place: contiguous tensors, and 2-D row-strided ones whose rows are contiguous (a column block of
the packed hidden states, `hidden[:, i * H:(i + 1) * H]`). `fused_stats` returns None for anything else (another
layout, a CPU tensor, a tensor too small to be worth a launch, no Triton): the caller takes the torch path.

A non-finite value makes the row's absmax inf (torch's amax says NaN where a NaN is); the nonfinite count says
which, and the detector reads a non-finite absmax the same either way (no log2). Sums are atomic, so the norm's
last bits vary run to run (the statistics are for trends, not for bitwise comparison).
"""
from __future__ import annotations

import functools

import torch

MIN_ELEMENTS = 1 << 16
"""Tensors below this many elements take the torch path: the launches cost more than the passes they save."""
BLOCK = 4096          # elements a program reads per iteration
WARPS = 8
PROGRAMS_PER_SM = 4   # programs launched per SM (each strides over its share of blocks)


@functools.lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel, built on first use (Triton imported where used); None where Triton is absent."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def stats_kernel(x_ptr, out_ptr, n, cols, row_stride, near_above, tiny, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        idx = tl.arange(0, BLOCK)
        top = tl.zeros([BLOCK], dtype=tl.float32)
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        near = tl.zeros([BLOCK], dtype=tl.int32)
        under = tl.zeros([BLOCK], dtype=tl.int32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid.to(tl.int64) * BLOCK, n.to(tl.int64), programs.to(tl.int64) * BLOCK):
            offs = start + idx
            inside = offs < n
            rows = offs // cols
            x = tl.load(x_ptr + rows * row_stride + (offs - rows * cols), mask=inside, other=0.0).to(tl.float32)
            a = tl.abs(x)
            finite = a < float("inf")   # false for NaN and Inf
            top = tl.maximum(top, tl.where(finite, a, float("inf")))
            squares += x * x
            near += (a > near_above).to(tl.int32)
            under += ((a < tiny) & (a > 0.0)).to(tl.int32)
            bad += (~finite).to(tl.int32)
        tl.atomic_max(out_ptr, tl.max(top, axis=0))
        tl.atomic_add(out_ptr + 1, tl.sum(squares, axis=0))
        tl.atomic_add(out_ptr + 2, tl.sum(near, axis=0).to(tl.float32))
        tl.atomic_add(out_ptr + 3, tl.sum(under, axis=0).to(tl.float32))
        tl.atomic_add(out_ptr + 4, tl.sum(bad, axis=0).to(tl.float32))

    return stats_kernel


def _layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(columns, row stride) the kernel reads `t` with, None for a layout it does not read in place."""
    if t.is_contiguous():
        return max(t.numel(), 1), 0
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]:
        return t.shape[1], t.stride(0)
    return None


@functools.lru_cache(maxsize=8)
def _programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count * PROGRAMS_PER_SM


def fused_stats(t: torch.Tensor, near_above: float, tiny: float) -> torch.Tensor | None:
    """`t`'s STATS row (absmax, norm, near-overflow, underflow and non-finite counts; float32 on its device) in one
    pass, enqueued only; None where the torch path must take it (see the module's docstring). `near_above`: |x|
    above it counts as near overflow; `tiny`: nonzero |x| below it counts as underflow."""
    if not t.is_cuda or t.numel() < MIN_ELEMENTS or not t.is_floating_point():
        return None
    layout = _layout(t)
    kernel = _kernel() if layout is not None else None
    if kernel is None:
        return None
    cols, row_stride = layout
    out = torch.zeros(5, dtype=torch.float32, device=t.device)
    programs = min(triton_cdiv(t.numel(), BLOCK), _programs(t.device.index or 0))
    with torch.cuda.device(t.device):
        kernel[(programs,)](t, out, t.numel(), cols, row_stride, near_above, tiny, BLOCK=BLOCK, num_warps=WARPS)
    out[1:2].sqrt_()
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
