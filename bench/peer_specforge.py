"""The peer in bench_drafter.py: SpecForge's DFlash training step at the same shapes, in the same process.

SpecForge (`pip install specforge`, 0.2.0) is a pure-Python wheel whose DFlash trainer step is
`specforge.algorithms.common.dflash_family_model.OnlineDFlashModel` around
`specforge.modeling.draft.dflash.DFlashDraftModel`: its own anchor sampling, draft blocks, mask and weighted
loss. Its dependencies (torch, transformers) are ours, so on the device machine, which reaches no package
index, it is carried as a wheel and installed with `--no-deps` (bench/gpu/env.sh installs every `.whl/*.whl`).
`version()` says whether it is importable; without it the table says "not installed", never a typed-in figure.

The peer is timed exactly as our rows are (sync, compute the loss, backward, sync; median of the timed steps
after warm-up) on the same documents, hidden states and loss mask, laid out as SpecForge takes them: one row
per document ([docs, doc_len]). Attention: FlexAttention on CUDA (as SpecForge trains), SDPA on the CPU
(`--tiny`, where flex has no backward).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import statistics
import time

import torch
from torch import nn

PACKAGE = "specforge"


def version() -> str | None:
    """SpecForge's installed version when it can be imported here, else None."""
    if importlib.util.find_spec(PACKAGE) is None:
        return None
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:   # importable from a path without its metadata
        return "unknown version"


def build(shape, device, backend: str) -> nn.Module:
    """SpecForge's OnlineDFlashModel at `shape` (bench_drafter.Shape), bf16, seeded like our rows."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    s = shape
    cfg = Qwen3Config(hidden_size=s.hidden, intermediate_size=s.inter, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                      vocab_size=s.vocab, max_position_embeddings=max(4096, s.doc_len * 2),
                      layer_types=["full_attention"] * s.layers)
    cfg.block_size, cfg.num_target_layers = s.block, s.num_target_layers
    cfg.dflash_config = {"target_layer_ids": list(s.target_layer_ids), "mask_token_id": s.vocab - 1}
    cfg._attn_implementation = backend
    torch.manual_seed(0)
    with torch.device(device):
        draft = DFlashDraftModel(cfg).to(torch.bfloat16)
        embed = nn.Embedding(s.vocab, s.hidden, dtype=torch.bfloat16).requires_grad_(False)
        lm_head = nn.Linear(s.hidden, s.vocab, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        nn.init.normal_(lm_head.weight, std=0.02)
    return OnlineDFlashModel(draft, lm_head, embed, mask_token_id=s.vocab - 1, block_size=s.block,
                             attention_backend=backend, num_anchors=s.anchors, loss_decay_gamma=7.0)


def inputs(packed, shape) -> tuple:
    """(input_ids, hidden_states, loss_mask) of our packed batch, one row per document."""
    meta, docs = packed.meta(), shape.docs
    ids = packed.input_ids.view(docs, shape.doc_len)
    hidden = packed.hidden.view(docs, shape.doc_len, -1)
    mask = meta["loss_mask"].to(packed.hidden.device).view(docs, shape.doc_len).float()
    return ids, hidden, mask


def time_peer(packed, shape, repeats: int, warmup: int, device, sync) -> dict:
    """The peer's row: median and min step time, first step, peak memory, loss; `sync(device)` bounds a step."""
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    model, (ids, hidden, mask) = build(shape, device, backend), inputs(packed, shape)
    cuda, times_ms, first_s = device.type == "cuda", [], math.nan
    torch.manual_seed(0)   # its anchors are drawn with torch.rand on the device
    for i in range(warmup + repeats):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        t0 = time.perf_counter()
        loss, _, _ = model(input_ids=ids, hidden_states=hidden, loss_mask=mask)
        loss.backward()
        sync(device)
        if i == 0:
            first_s = time.perf_counter() - t0
        if i >= warmup:
            times_ms.append((time.perf_counter() - t0) * 1e3)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) if cuda else math.nan
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"backend": "flex" if cuda else "sdpa", "loss_variant": "specforge", "fused": "-",
            "median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "first_step_s": first_s,
            "peak_mem_gib": peak / 2 ** 30, "loss": float(loss.detach()), "tau": None, "peer": True}
