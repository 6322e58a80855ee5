"""Weighted cross entropy through the frozen LM head, in row chunks: the [rows, vocab] logits are
never held whole. Per chunk: the logits as `DFlashDraftModel.logits` computes them, the float32 math of
`F.cross_entropy(logits.float())`, and already in the forward the [rows, H] gradient w.r.t. the rows
(the only thing saved; backward scales it). On CUDA the softmax/gradient/argmax is one compiled kernel
per chunk (`fused_ce`). Row counts come from shapes: no host-device sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_LOGIT_BYTES = 1 << 30
"""Budget of logits per chunk, in bytes of the matmul's output dtype (1 GiB)."""


def chunk_rows_for(vocab_size: int, logit_itemsize_bytes: int, budget_bytes: int = CHUNK_LOGIT_BYTES) -> int:
    """Rows per chunk so that one chunk's logits take at most `budget_bytes` (at least one row)."""
    return max(1, budget_bytes // (vocab_size * logit_itemsize_bytes))


def _matmul_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast would run `lm_head(hidden.to(weight.dtype))` in: its own, or the weight's."""
    if weight_dtype.is_floating_point and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


def _ce_grad_eager(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """Per row: CE (float32), d(sum scale*CE)/d logits in logits' dtype, argmax == target; the math of
    F.cross_entropy(logits.float()) and its backward, buffers reused in place."""
    correct = logits.argmax(-1) == targets
    logp = torch.log_softmax(logits.float(), -1)
    ce = -logp.gather(1, targets[:, None]).squeeze(1)
    prob = logp.exp_().mul_(scale[:, None])
    prob.scatter_add_(1, targets[:, None], -scale[:, None])
    return ce, prob.to(logits.dtype), correct


def _ce_grad_math(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """The same three results written for Inductor to fuse (no in-place ops, no scatter)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, -1, keepdim=True)
    ce = (lse - lf.gather(1, targets[:, None])).squeeze(1)
    prob = torch.exp(lf - lse) * scale[:, None]
    cols = torch.arange(lf.shape[1], device=lf.device)
    grad = torch.where(cols[None, :] == targets[:, None], prob - scale[:, None], prob)
    return ce, grad.to(logits.dtype), logits.argmax(-1) == targets


_ce_grad_compiled = None


def _ce_grad_fused(logits, targets, scale):
    """`_ce_grad_math` compiled on first use, the row count dynamic (the last chunk is ragged)."""
    global _ce_grad_compiled
    if _ce_grad_compiled is None:
        _ce_grad_compiled = torch.compile(_ce_grad_math)
    for t in (logits, targets, scale):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return _ce_grad_compiled(logits, targets, scale)


class _ChunkedLinearCE(torch.autograd.Function):
    """Forward: loss, correct flags and d loss / d hidden chunk by chunk; backward scales the latter."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_weight, total_weight, chunk_rows, fused, need_grad):
        device = hidden.device
        dtype = _matmul_dtype(device.type, weight.dtype)
        step = _ce_grad_fused if fused else _ce_grad_eager
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=device)
        correct = torch.empty(n, dtype=torch.bool, device=device)
        grad = torch.empty(n, hidden.shape[1], dtype=dtype, device=device) if need_grad else None
        scale = row_weight.to(torch.float32) / total_weight
        # The casts autocast would make, made once; the matmuls then run as autocast would run them.
        with torch.autocast(device.type, enabled=False):
            w = weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            for start in range(0, n, chunk_rows):
                end = min(n, start + chunk_rows)
                logits = F.linear(hidden[start:end].to(weight.dtype).to(dtype), w, b)
                ce_rows, grad_logits, correct_rows = step(logits, targets[start:end], scale[start:end])
                del logits
                ce[start:end] = ce_rows
                correct[start:end] = correct_rows
                if need_grad:
                    torch.mm(grad_logits, w, out=grad[start:end])
                del grad_logits
        loss = (ce * row_weight).sum() / total_weight
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad,) = ctx.saved_tensors
        return grad.to(ctx.hidden_dtype) * grad_loss, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, row_weight: torch.Tensor, total_weight: float, *,
                         chunk_rows: int | None = None, fused: bool | None = None):
    """(loss, correct): `sum_i row_weight[i] * CE(logits_i, targets[i]) / total_weight`, differentiable
    w.r.t. `hidden` [R, H], and [R] argmax(logits_i) == targets[i], logits = F.linear(hidden, weight, bias)
    under the caller's autocast; the head frozen, `total_weight` a host float."""
    n = hidden.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)}")
    if targets.shape != (n,) or row_weight.shape != (n,):
        raise ValueError(f"linear_cross_entropy: targets {tuple(targets.shape)} / row_weight "
                         f"{tuple(row_weight.shape)} for {n} rows")
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("linear_cross_entropy: the head must be frozen (it gets no gradient)")
    if chunk_rows is None:
        itemsize = _matmul_dtype(hidden.device.type, weight.dtype).itemsize
        chunk_rows = chunk_rows_for(weight.shape[0], itemsize, CHUNK_LOGIT_BYTES)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows: must be >= 1, got {chunk_rows}")
    if fused is None:
        fused = hidden.is_cuda
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _ChunkedLinearCE.apply(hidden, weight, bias, targets, row_weight, float(total_weight),
                                  int(chunk_rows), bool(fused), need_grad)


def reference_linear_cross_entropy(hidden, weight, bias, targets, row_weight, total_weight, **_):
    """The unchunked loss (all logits at once, autograd backward): the tests' and bench's baseline."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias)
    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    loss = (ce * row_weight).sum() / total_weight
    with torch.no_grad():
        correct = logits.argmax(-1) == targets
    return loss, correct
