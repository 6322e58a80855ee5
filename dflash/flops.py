"""Model FLOPs of a training step, from shapes and the batch's CPU metadata only: no device tensor is read,
so counting never syncs with the GPU. The numerators of MFU and TFLOP/s (the denominators, the GPU's peaks, are
the profiler's: profiler/floors.py `compute_peaks`).

Convention (bench/bench_drafter.py's `model_flops`, which `drafter_step_flops` reproduces exactly):

- model FLOPs: 2 per multiply-add, matmuls only (norms, RoPE, softmax, SiLU*up, biases, embedding look-ups and
  the loss's elementwise math are not counted);
- fwd+bwd = 3x fwd for a trained weight (forward, input-grad, weight-grad), and 3x fwd for attention's
  QK^T and PV; the frozen LM head: 2x (forward and input-grad, no weight-grad); the drafter's fc: 2x (forward
  and weight-grad; its input, the target's features, needs no gradient);
- useful rows only: padding the kernels also compute (the drafter's padded layout, the target's right-padded
  rows) is not counted, so it shows up as lower MFU;
- attention: masked-in (query, key) pairs only; not the dense [Q, KV] matrix a kernel may evaluate;
- the LM head only on the rows the loss computes it for (dflash.lm_loss: block positions with a target).

`torch.utils.flop_counter.FlopCounterMode` counts what ran instead: the dense attention matrix, padded rows,
every weight's gradient that autograd forms (tests/test_flops.py checks both against it, term by term).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _cpu(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as int64, refusing a device tensor (reading one would sync with the GPU)."""
    if t.device.type != "cpu":
        raise ValueError(f"{name}: must be a CPU tensor (the batch's host metadata), got one on {t.device}")
    return t.to(torch.int64)


def drafter_attention_pairs(anchors: torch.Tensor, doc_ids: torch.Tensor, position_ids: torch.Tensor,
                            block_size: int, sliding_window: int | None = None) -> int:
    """Masked-in (query, key) pairs of one drafter layer (dflash.attention's rule), real blocks only.

    Block j (anchor at flat index a) has B query rows; row r sees the context keys of a's document with flat
    index < a, and on a sliding layer only those with (pos[a] + r) - pos[key] < window; and the B keys of its
    own block (with |r - r'| < window on a sliding layer). CPU tensors: `anchors` [M] flat indices,
    `doc_ids` [N] non-decreasing, `position_ids` [N] increasing within each document (as packed)."""
    a, doc = _cpu("anchors", anchors), _cpu("doc_ids", doc_ids)
    if a.numel() == 0:
        return 0
    if bool((doc[1:] < doc[:-1]).any()):
        raise ValueError("doc_ids: must be non-decreasing (each document's tokens contiguous, as packed)")
    start = torch.searchsorted(doc, doc[a])                     # flat index of each anchor's document start
    r = torch.arange(block_size)
    if sliding_window is None:
        return int((a - start).sum()) * block_size + a.numel() * block_size * block_size
    pos = _cpu("position_ids", position_ids)
    # (document, position) as one sorted key: the keys a row sees are the same document's after a threshold.
    span = int(pos.max()) + block_size + 1
    key = doc * span + pos
    lowest = doc[a, None] * span + pos[a, None] + r[None, :] - sliding_window   # seen: key > lowest
    first = torch.searchsorted(key, lowest, right=True).clamp(min=start[:, None])
    ctx = int((a[:, None] - first).clamp(min=0).sum())
    own = int(((r[:, None] - r[None, :]).abs() < sliding_window).sum())
    return ctx + a.numel() * own


def drafter_flops(config, num_ctx_tokens: int, num_queries: int, attn_pairs: int | Sequence[int],
                  num_lm_rows: int) -> float:
    """Model FLOPs of one drafter fwd+bwd from counts (the module's convention).

    `config`: a DFlashConfig. `num_ctx_tokens`: context tokens N (fc and every layer's k/v projections);
    `num_queries`: block rows M*B (q/o projections, k/v of the block, MLP); `attn_pairs`: masked-in pairs of
    each layer (one int for all layers, or one per layer); `num_lm_rows`: rows the frozen LM head computes."""
    c = config
    layers = c.num_hidden_layers
    pairs = [attn_pairs] * layers if isinstance(attn_pairs, int) else list(attn_pairs)
    if len(pairs) != layers:
        raise ValueError(f"attn_pairs: {len(pairs)} entries for {layers} layers")
    h, d = c.hidden_size, c.head_dim
    n, q = num_ctx_tokens, num_queries
    linear = (2 * q * h * c.num_attention_heads * d * 2          # q_proj, o_proj
              + 2 * (n + q) * h * c.num_key_value_heads * d * 2  # k_proj, v_proj on context + block
              + 2 * q * h * c.intermediate_size * 3)             # gate, up, down
    attn = sum(4 * p * c.num_attention_heads * d for p in pairs)  # QK^T and PV on masked-in pairs
    fc = 2 * n * len(c.target_layer_ids) * h * h
    head = 2 * num_lm_rows * h * c.vocab_size
    return float(3 * (layers * linear + attn) + 2 * fc + 2 * head)


def drafter_lm_rows(anchors: torch.Tensor, doc_ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int) -> int:
    """Block positions k = 1..B-1 with a target (dflash.loss.block_targets' validity): the LM head's rows."""
    a, doc, lm = _cpu("anchors", anchors), _cpu("doc_ids", doc_ids), _cpu("loss_mask", loss_mask).to(torch.bool)
    n = doc.shape[0]
    idx = a[:, None] + torch.arange(1, block_size)[None, :]
    safe = idx.clamp(max=n - 1)
    return int(((idx < n) & (doc[safe] == doc[a][:, None]) & lm[safe]).sum())


def drafter_step_flops(config, meta: dict[str, torch.Tensor], anchors: torch.Tensor,
                       num_lm_rows: int | None = None) -> float:
    """Model FLOPs of one drafter fwd+bwd (the training step's compute_loss + backward), host data only.

    `config`: the drafter's DFlashConfig (model.config); `meta`: the batch's CPU metadata (PackedBatch.meta():
    doc_ids, position_ids, loss_mask); `anchors`: the CPU anchors dflash.loss.sample_anchors drew for the step;
    `num_lm_rows`: the LM head's rows when known (LossOutput.num_targets), else counted from the loss mask.
    Equals bench/bench_drafter.py's model_flops for the same batch and anchors (full-attention layers; a sliding
    layer counts its window's pairs). No anchors: 0 (compute_loss then runs no model)."""
    bs, m = config.block_size, int(anchors.shape[0])
    if m == 0:
        return 0.0
    doc, pos = meta["doc_ids"], meta["position_ids"]
    if num_lm_rows is None:
        num_lm_rows = drafter_lm_rows(anchors, doc, meta["loss_mask"], bs)
    windows = [config.window(i) for i in range(config.num_hidden_layers)]
    per_window = {w: drafter_attention_pairs(anchors, doc, pos, bs, w) for w in set(windows)}
    return drafter_flops(config, int(doc.shape[0]), m * bs, [per_window[w] for w in windows], num_lm_rows)


def causal_pairs(doc_lens: torch.Tensor, sliding_window: int | None = None) -> int:
    """(query, key) pairs of causal attention within each document: sum of L(L+1)/2; with a window, query i
    sees min(i + 1, window) keys (transformers' sliding-window mask)."""
    lens = _cpu("doc_lens", torch.as_tensor(doc_lens))
    if sliding_window is None:
        return int((lens * (lens + 1) // 2).sum())
    w = sliding_window
    inside = lens.clamp(max=w)
    return int((inside * (inside + 1) // 2 + (lens - inside) * w).sum())


def target_forward_flops(config, doc_lens, layer_ids: Sequence[int], lm_head: bool = False) -> float:
    """Model FLOPs of the frozen target's forward (no backward) over a batch of documents, one a row.

    `config`: the target's transformers config (a dense decoder: q/k/v/o and a gated MLP per layer);
    `doc_lens`: each document's real tokens (a CPU tensor or ints: Batch.attention_mask.sum(1)); `layer_ids`:
    the captured layers (TargetCapture.layer_ids): layers 0..max(layer_ids) run, later ones do not;
    `lm_head`: count the LM head on every token (TargetCapture never runs it). Attention: causal pairs within
    each document (sliding layers: their window); the right padding the kernels also compute is not counted."""
    c = getattr(config, "text_config", None) or config
    lens = torch.as_tensor(doc_lens)
    tokens = int(_cpu("doc_lens", lens).sum())
    h, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or h // heads
    run = max(layer_ids) + 1
    if run > c.num_hidden_layers:
        raise ValueError(f"layer_ids: {list(layer_ids)} out of range for {c.num_hidden_layers} layers")
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    window = getattr(c, "sliding_window", None)
    linear = 2 * tokens * h * (heads * d * 2 + kv * d * 2 + c.intermediate_size * 3)
    attn = sum(4 * heads * d * causal_pairs(lens, window if types[i] == "sliding_attention" else None)
               for i in range(run))
    head = 2 * tokens * h * c.vocab_size if lm_head else 0
    return float(run * linear + attn + head)
