"""Drafter fwd+bwd at Qwen3-8B shapes: flex vs dense attention, against a public trainer's 356 ms.

    python3 bench/bench_drafter.py [--repeats 8] [--backends flex,dense]

Shapes: 5-layer drafter (hidden 4096, 32 heads, 8 kv heads, head_dim 128, intermediate 12288,
vocab 151936), K=5 target layers, bf16 parameters, block 16, 2 documents x 3072 tokens, 512 anchors
per document. One step = compute_loss (CPU anchor sampling included) + backward; median of
`repeats` after warm-up (which includes torch.compile of flex). MFU = useful model FLOPs (masked
attention pairs only; no weight-grad for the frozen LM head / no input-grad for fc) / time /
the bf16 matmul peak measured in this run. Writes bench_drafter.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dflash.attention import build_layout, dense_mask
from dflash.loss import block_targets, compute_loss, sample_anchors
from dflash.model import DFlashConfig, DFlashDraftModel
from dflash.pack import PackedBatch

PEER_MS = 356.0  # public DFlash trainer, same shapes (fwd+bwd)
H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, K = 4096, 32, 8, 128, 12288, 151936, 5
LAYERS, BLOCK, DOC_LEN, DOCS, ANCHORS = 5, 16, 3072, 2, 512


def matmul_peak_flops(device, n=8192, iters=20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()  # benchmark timing sync
    return 2 * n ** 3 * iters / (start.elapsed_time(end) / 1e3)


def make_batch(device) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    n = DOC_LEN * DOCS
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    doc = torch.arange(DOCS, dtype=torch.int32).repeat_interleave(DOC_LEN)
    pos = torch.arange(DOC_LEN).repeat(DOCS)
    lm = torch.ones(n, dtype=torch.bool)
    lm[:64] = False  # a prompt at the start of each document
    lm[DOC_LEN:DOC_LEN + 64] = False
    hidden = torch.randn(n, K * H, device=device, dtype=torch.bfloat16)
    meta = {"input_ids": ids, "position_ids": pos, "doc_ids": doc, "loss_mask": lm}
    return PackedBatch(hidden, ids.to(device), pos.to(device), doc.to(device), lm.to(device), 0, False, meta)


def model_flops(packed: PackedBatch, device) -> float:
    """Useful FLOPs of one fwd+bwd for the anchors seed 0 draws (same for every repeat)."""
    meta = packed.meta()
    anchors = sample_anchors(meta["loss_mask"], meta["doc_ids"], ANCHORS, torch.Generator().manual_seed(0))
    m, n = len(anchors), packed.num_tokens
    _, valid = block_targets(anchors, meta["loss_mask"], meta["doc_ids"], BLOCK)
    rows = int(valid.sum())
    q = m * BLOCK
    lay = build_layout(packed.doc_ids, packed.position_ids, meta["doc_ids"][anchors].to(device),
                       anchors.to(device), meta["position_ids"][anchors].to(device), BLOCK)
    pairs = float(dense_mask(lay, None)[: q].sum())  # benchmark setup, sync is fine
    per_layer = (2 * q * H * HEADS * HEAD_DIM * 2            # q_proj, o_proj
                 + 2 * (n + q) * H * KV_HEADS * HEAD_DIM * 2  # k_proj, v_proj on context + block
                 + 2 * q * H * INTER * 3                      # MLP
                 + 4 * pairs * HEADS * HEAD_DIM)              # QK^T and PV on visible pairs
    fc = 2 * n * K * H * H
    head = 2 * rows * H * VOCAB
    return 3 * LAYERS * per_layer + 2 * fc + 2 * head


def build_model(backend: str, device) -> DFlashDraftModel:
    cfg = DFlashConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                       target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=VOCAB - 1, num_target_layers=36,
                       block_size=BLOCK, attn_backend=backend)
    with torch.device(device):
        embed = nn.Embedding(VOCAB, H, dtype=torch.bfloat16)
        lm_head = nn.Linear(H, VOCAB, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(lm_head.weight, std=0.02)
        model = DFlashDraftModel(cfg, embed, lm_head)
    return model.to(torch.bfloat16)


def time_backend(backend: str, packed: PackedBatch, repeats: int, warmup: int, device) -> dict:
    model = build_model(backend, device)
    ctx = packed.context(0.0)
    times_ms = []
    torch.cuda.reset_peak_memory_stats(device)
    t_warm = time.perf_counter()
    for i in range(warmup + repeats):
        torch.cuda.synchronize(device)  # benchmark timing sync
        t0 = time.perf_counter()
        out = compute_loss(model, packed, ctx, ANCHORS, 7.0, torch.Generator().manual_seed(0))
        out.loss.backward()
        torch.cuda.synchronize(device)  # benchmark timing sync
        if i >= warmup:
            times_ms.append((time.perf_counter() - t0) * 1e3)
        elif i == warmup - 1:
            t_warm = time.perf_counter() - t_warm
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device)
    del model
    torch.cuda.empty_cache()
    return {"backend": backend, "median_ms": statistics.median(times_ms), "min_ms": min(times_ms),
            "warmup_s": t_warm, "peak_mem_gib": peak / 2 ** 30, "loss": float(out.loss)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", default="flex,dense")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_drafter: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    peak = matmul_peak_flops(device)
    packed = make_batch(device)
    flops = model_flops(packed, device)
    rows = [time_backend(b, packed, args.repeats, args.warmup, device) for b in args.backends.split(",")]
    tokens = packed.num_tokens
    print(f"drafter fwd+bwd, {DOCS}x{DOC_LEN} tokens, {ANCHORS} anchors/doc, block {BLOCK}, bf16; "
          f"measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; model {flops / 1e12:.1f} TFLOP/step")
    print(f"{'backend':<10}{'median ms':>10}{'min ms':>9}{'tokens/s':>11}{'MFU':>7}{'vs peer':>9}"
          f"{'peak GiB':>10}{'warmup s':>10}{'loss':>8}")
    for r in rows:
        r["tokens_per_s"] = tokens / (r["median_ms"] / 1e3)
        r["mfu"] = flops / (r["median_ms"] / 1e3) / peak
        print(f"{r['backend']:<10}{r['median_ms']:>10.1f}{r['min_ms']:>9.1f}{r['tokens_per_s']:>11.0f}"
              f"{r['mfu']:>7.1%}{PEER_MS / r['median_ms']:>8.2f}x{r['peak_mem_gib']:>10.1f}"
              f"{r['warmup_s']:>10.1f}{r['loss']:>8.3f}")
    print(f"{'peer':<10}{PEER_MS:>10.1f}{'':>9}{tokens / (PEER_MS / 1e3):>11.0f}"
          f"{flops / (PEER_MS / 1e3) / peak:>7.1%}{1.0:>8.2f}x   (public trainer, same shapes)")
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_drafter.json").write_text(json.dumps(
            {"peak_flops": peak, "model_flops": flops, "tokens": tokens, "peer_ms": PEER_MS, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
