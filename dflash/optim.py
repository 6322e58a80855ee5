"""AdamW with linear warm-up then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier on the peak lr at optimiser step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params, lr: float, weight_decay: float, warmup_steps: int, total_steps: int,
                    min_ratio: float) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in params if p.requires_grad]
    # fused=True only on CUDA: one kernel for the whole update instead of several per tensor.
    fused = bool(params) and params[0].is_cuda
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup_steps, total_steps, min_ratio))
    return opt, sched
