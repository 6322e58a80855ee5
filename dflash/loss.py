"""The DFlash training loss over all draft blocks of a packed batch. Everything data-dependent (anchors,
valid positions, weights, counts) is decided on the CPU from the batch's CPU metadata and shipped as
index tensors: no device->host sync; the LM head runs only on rows with a target (dflash.lm_loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.attention import build_layout
from dflash.flops import drafter_step_flops
from dflash.lm_loss import linear_cross_entropy
from dflash.pack import PackedBatch


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar, differentiable: weighted CE over valid block positions / sum of their weights."""
    acc: torch.Tensor
    """[B-1] accuracy of block position k = 1..B-1 (0 where no position k had a target)."""
    tau: torch.Tensor
    """Scalar simulated acceptance length 1 + sum_k prod_{i<=k} acc_i."""
    num_anchors: int
    """Draft blocks in this batch (known on the CPU)."""
    num_targets: int
    """Valid (anchor, k) targets the loss averaged over (known on the CPU)."""
    tau_prefix: torch.Tensor | None = None
    """Scalar: 1 + mean over anchors of the leading run of correct predictions (what a verify step
    would accept teacher-forced; unlike `tau` it keeps the correlation between positions)."""
    model_flops: float = 0.0
    """Model FLOPs of this step's forward and backward (dflash/flops.py's convention), counted on the host."""


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Sorted flat indices a with loss_mask[a] and loss_mask[a+1] in the same document, at most
    num_anchors per document, drawn uniformly without replacement (CPU tensors, CPU generator)."""
    lm = loss_mask.to(torch.bool)
    ok = lm[:-1] & lm[1:] & (doc_ids[:-1] == doc_ids[1:])
    cand = ok.nonzero().squeeze(1)
    if cand.numel() == 0:
        return cand
    docs = doc_ids[cand].to(torch.int64)
    keys = torch.rand(cand.shape[0], generator=generator, dtype=torch.float64)
    # Sort by (document, random key): within each document the order is a random permutation.
    order = torch.argsort(docs.to(torch.float64) * 2.0 + keys)
    sorted_docs = docs[order]
    starts = torch.ones_like(sorted_docs, dtype=torch.bool)
    starts[1:] = sorted_docs[1:] != sorted_docs[:-1]
    first = torch.cummax(torch.where(starts, torch.arange(len(order)), 0), 0).values
    rank = torch.arange(len(order)) - first
    return torch.sort(cand[order[rank < num_anchors]]).values


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma)


def block_targets(anchors: torch.Tensor, loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int):
    """[M, B-1] target flat indices (clamped) and validity: a+k exists, same document, loss-masked."""
    n = loss_mask.shape[0]
    idx = anchors[:, None] + torch.arange(1, block_size)[None, :]
    safe = idx.clamp(max=n - 1)
    valid = (idx < n) & (doc_ids[safe] == doc_ids[anchors][:, None]) & loss_mask.to(torch.bool)[safe]
    return safe, valid


def compute_loss(model, packed: PackedBatch, context: torch.Tensor, num_anchors: int, gamma: float,
                 generator: torch.Generator, fused_ce: bool = True) -> LossOutput:
    """The weighted block loss, per-position accuracy and tau over up to `num_anchors` anchors per
    document (CPU `generator`); `context`: the drafter's [N, K*H] input."""
    meta = packed.meta()
    bs = model.block_size
    device = context.device
    anchors = sample_anchors(meta["loss_mask"], meta["doc_ids"], num_anchors, generator)
    m = int(anchors.shape[0])
    if m == 0:
        # Still a differentiable scalar touching every parameter (data-parallel peers all-reduce).
        zero = sum(p.sum() for p in model.parameters()) * 0.0
        one = torch.ones((), device=device)
        return LossOutput(zero, torch.zeros(bs - 1, device=device), one, 0, 0, one)

    safe, valid = block_targets(anchors, meta["loss_mask"], meta["doc_ids"], bs)
    w = position_weights(bs, gamma)
    rows = valid.reshape(-1).nonzero().squeeze(1)              # valid (anchor, k) pairs
    k_of_row = rows % (bs - 1)
    row_weight = w[k_of_row]
    total_weight = float(row_weight.sum())                     # CPU value, no sync
    counts = torch.bincount(k_of_row, minlength=bs - 1).to(torch.float32)
    # Hidden row of (anchor j, position k) in the padded [Mp*B, H] output: j*B + k.
    hidden_rows = (rows // (bs - 1)) * bs + k_of_row + 1
    host = torch.cat([anchors, safe.reshape(-1)[rows], hidden_rows, k_of_row, rows])
    r = rows.shape[0]
    a_dev, tgt_idx, h_rows, k_dev, rows_dev = host.to(device, non_blocking=True).split([m, r, r, r, r])
    a_meta = torch.stack([meta["doc_ids"][anchors].to(torch.int64), meta["position_ids"][anchors]])
    a_meta = a_meta.to(device, non_blocking=True)
    weights_dev = row_weight.to(torch.float32).to(device, non_blocking=True)
    counts_dev = counts.to(device, non_blocking=True)

    layout = build_layout(packed.doc_ids, packed.position_ids, a_meta[0], a_dev, a_meta[1], bs)
    block = torch.full((m, bs), model.mask_token_id, dtype=torch.int64, device=device)
    block[:, 0] = packed.input_ids[a_dev]
    hidden = model(context, block, layout)
    head = model.head.lm_head  # frozen: the loss forms d loss / d hidden only, chunk by chunk
    loss, correct = linear_cross_entropy(hidden.index_select(0, h_rows), head.weight, head.bias,
                                         packed.input_ids[tgt_idx], weights_dev, total_weight,
                                         fused=fused_ce and hidden.is_cuda)
    with torch.no_grad():
        correct = correct.to(torch.float32)
        hits = torch.zeros(bs - 1, device=device).index_add_(0, k_dev, correct)
        acc = hits / counts_dev.clamp(min=1.0)
        tau = 1.0 + torch.cumprod(acc, 0).sum()
        # Per-anchor accepted prefix: an invalid target (past the document's end) ends it too.
        grid = torch.zeros(m * (bs - 1), device=device).index_copy_(0, rows_dev, correct)
        tau_prefix = 1.0 + grid.view(m, bs - 1).cumprod(1).sum(1).mean()
    config = getattr(model, "config", None)   # a stand-in model of the tests has none: no FLOPs to count
    flops = drafter_step_flops(config, meta, anchors, r) if config is not None else 0.0   # host data only: no sync
    return LossOutput(loss, acc, tau, m, r, tau_prefix, flops)

