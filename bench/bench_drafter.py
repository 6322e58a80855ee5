"""Drafter fwd+bwd at Qwen3-8B shapes: flex vs dense attention, chunked vs unchunked LM-head loss.

    python3 bench/bench_drafter.py [--repeats 8] [--backends flex,dense] [--loss chunked]
                                   [--fused on|off|both] [--tiny] [--no-peer]

Shapes: 5-layer drafter (hidden 4096, 32 heads, 8 kv heads, head_dim 128, intermediate 12288,
vocab 151936), K=5 target layers, bf16 parameters, block 16, 2 documents x 3072 tokens, 512 anchors
per document. One step = compute_loss (CPU anchor sampling included) + backward; median of
`repeats` after warm-up (which includes torch.compile of flex). MFU = useful model FLOPs (masked
attention pairs only; no weight-grad for the frozen LM head / no input-grad for fc) / time /
the bf16 matmul peak measured in this run. Peak GiB = max allocated over the timed steps (after
warm-up). Writes bench_drafter.json under $OUT when set.

`--loss` picks the LM-head loss (comma-separated, one row per backend and loss): `unchunked` is the
computation before dflash.lm_loss (all [rows, vocab] logits at once, then .float(), cross_entropy,
argmax), `chunked` is dflash.lm_loss's eager path, `fused` its torch.compile'd elementwise path
(the trainer's default on CUDA); `both` means all three. Every row builds the same seeded model, so the
loss column must agree across loss variants. `--tiny` runs tiny shapes on the CPU with the dense backend
and 1 MiB of logits a chunk, so the tiny vocabulary still takes several chunks (a smoke test of this
script; its timings mean nothing).

`--fused` builds the drafter with `fused_elementwise` on or off: its compiled RMSNorm / add+RMSNorm / q,k norm+RoPE /
SiLU*mul kernels (CUDA only; default on, as in the trainer); `both` runs each row off, then on.
`first s` is the first step's wall time: it holds torch.compile of flex (in the first row) and of
the fused kernels (in the first row with them on). In `--fused both` the off row runs first, so the
on row's first s minus its median step is what the fused kernels add to a start (cold, or loads from
TORCHINDUCTOR_CACHE_DIR when it already holds them).

The peer, SpecForge's DFlash training step (bench/peer_specforge.py: its OnlineDFlashModel, anchors,
mask and loss), is measured in the same process on the same documents, hidden states and loss mask, timed
the same way, whenever `specforge` is importable; its row is the table's last and says its version. It is a
pure-Python wheel: on the device machine, which reaches no package index, carry it as
`.whl/specforge-0.2.0-py3-none-any.whl` (bench/gpu/env.sh installs it with `--no-deps`; torch and
transformers are ours). Without it the last line says the peer was not measured, never a figure typed in
from another session. `--no-peer` leaves it out.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from collections import namedtuple

import torch
from torch import nn

import common
import peer_specforge
import dflash.loss as loss_mod
from dflash import lm_loss
from dflash.attention import build_layout, dense_mask
from dflash.loss import block_targets, compute_loss, sample_anchors
from dflash.model import DFlashConfig, DFlashDraftModel
from dflash.pack import PackedBatch


# The drafter's and the batch's shape in one benchmark setting; `anchors` are per document.
Shape = namedtuple("Shape", "hidden heads kv_heads head_dim inter vocab target_layer_ids num_target_layers "
                            "layers block doc_len docs anchors")

QWEN3_8B = Shape(4096, 32, 8, 128, 12288, 151936, (1, 9, 17, 25, 33), 36, 5, 16, 3072, 2, 512)
TINY = Shape(64, 4, 2, 16, 128, 4096, (1, 3), 6, 2, 16, 128, 2, 8)


LOSSES = {"unchunked": lm_loss.reference_linear_cross_entropy,
          "chunked": functools.partial(lm_loss.linear_cross_entropy, fused=False),
          "fused": functools.partial(lm_loss.linear_cross_entropy, fused=True)}


def sync(device) -> None:
    """Wait for the device (benchmark timing boundary; a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark timing sync


def matmul_peak_flops(device, n=8192, iters=20) -> float:
    """Measured bf16 n x n x n matmul rate, FLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def make_batch(device, shape: Shape = QWEN3_8B) -> PackedBatch:
    """Two (or `shape.docs`) random documents, each with a 64-token (or shorter) prompt unmasked."""
    g = torch.Generator().manual_seed(0)
    n = shape.doc_len * shape.docs
    ids = torch.randint(0, shape.vocab, (n,), generator=g)
    doc = torch.arange(shape.docs, dtype=torch.int32).repeat_interleave(shape.doc_len)
    pos = torch.arange(shape.doc_len).repeat(shape.docs)
    lm = pos >= min(64, shape.doc_len // 4)  # a prompt at the start of each document
    hidden = torch.randn(n, len(shape.target_layer_ids) * shape.hidden, generator=g).to(device, torch.bfloat16)
    meta = {"input_ids": ids, "position_ids": pos, "doc_ids": doc, "loss_mask": lm}
    return PackedBatch(hidden, ids.to(device), pos.to(device), doc.to(device), lm.to(device), 0, False, meta)


def model_flops(packed: PackedBatch, device, shape: Shape = QWEN3_8B) -> float:
    """Useful FLOPs of one fwd+bwd for the anchors seed 0 draws (same for every repeat)."""
    s, meta = shape, packed.meta()
    anchors = sample_anchors(meta["loss_mask"], meta["doc_ids"], s.anchors, torch.Generator().manual_seed(0))
    m, n = len(anchors), packed.num_tokens
    _, valid = block_targets(anchors, meta["loss_mask"], meta["doc_ids"], s.block)
    rows = int(valid.sum())
    q = m * s.block
    lay = build_layout(packed.doc_ids, packed.position_ids, meta["doc_ids"][anchors].to(device),
                       anchors.to(device), meta["position_ids"][anchors].to(device), s.block)
    pairs = float(dense_mask(lay, None)[: q].sum())  # benchmark setup, sync is fine
    per_layer = (2 * q * s.hidden * s.heads * s.head_dim * 2             # q_proj, o_proj
                 + 2 * (n + q) * s.hidden * s.kv_heads * s.head_dim * 2  # k_proj, v_proj on context + block
                 + 2 * q * s.hidden * s.inter * 3                        # MLP
                 + 4 * pairs * s.heads * s.head_dim)                     # QK^T and PV on visible pairs
    fc = 2 * n * len(s.target_layer_ids) * s.hidden * s.hidden
    head = 2 * rows * s.hidden * s.vocab
    return 3 * s.layers * per_layer + 2 * fc + 2 * head


def build_model(backend: str, device, shape: Shape = QWEN3_8B, fused_elementwise: bool = True) -> DFlashDraftModel:
    """A bf16 drafter with a random frozen head, seeded: every call builds the same weights."""
    s = shape
    cfg = DFlashConfig(hidden_size=s.hidden, intermediate_size=s.inter, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                       vocab_size=s.vocab, target_layer_ids=list(s.target_layer_ids), mask_token_id=s.vocab - 1,
                       num_target_layers=s.num_target_layers, block_size=s.block, attn_backend=backend)
    torch.manual_seed(0)
    with torch.device(device):
        embed = nn.Embedding(s.vocab, s.hidden, dtype=torch.bfloat16)
        lm_head = nn.Linear(s.hidden, s.vocab, bias=False, dtype=torch.bfloat16)
        nn.init.normal_(lm_head.weight, std=0.02)
        model = DFlashDraftModel(cfg, embed, lm_head, fused_elementwise)
    return model.to(torch.bfloat16)


def time_variant(backend: str, loss: str, fused_on: bool, packed: PackedBatch, shape: Shape, repeats: int,
                 warmup: int, device) -> dict:
    """Median step time and peak memory of one (attention backend, LM-head loss, fused kernels) row."""
    model = build_model(backend, device, shape, fused_on)
    ctx = packed.context(0.0)
    times_ms = []
    cuda = device.type == "cuda"
    loss_mod.linear_cross_entropy = LOSSES[loss]
    first_s = math.nan
    try:
        for i in range(warmup + repeats):
            if i == warmup and cuda:
                # Peak of the timed steps alone: warm-up's compilation and autotuning (flex, the fused
                # loss) allocate too, and only in whichever row compiles first.
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            out = compute_loss(model, packed, ctx, shape.anchors, 7.0, torch.Generator().manual_seed(0))
            out.loss.backward()
            sync(device)
            if i == 0:
                first_s = time.perf_counter() - t0
            if i >= warmup:
                times_ms.append((time.perf_counter() - t0) * 1e3)
            model.zero_grad(set_to_none=True)
    finally:
        loss_mod.linear_cross_entropy = lm_loss.linear_cross_entropy
    peak = torch.cuda.max_memory_allocated(device) if cuda else math.nan
    del model
    if cuda:
        torch.cuda.empty_cache()
    return {"backend": backend, "loss_variant": loss, "fused": "on" if fused_on else "off",
            "median_ms": statistics.median(times_ms), "min_ms": min(times_ms),
            "first_step_s": first_s, "peak_mem_gib": peak / 2 ** 30,
            "loss": float(out.loss.detach()), "tau": float(out.tau)}


def print_rows(rows: list, shape: Shape, tokens: int, flops: float, peak: float) -> None:
    """The results table; its last line says which row is the peer, or why it was not measured."""
    print(f"drafter fwd+bwd, {shape.docs}x{shape.doc_len} tokens, {shape.anchors} anchors/doc, block "
          f"{shape.block}, bf16; chunk {lm_loss.CHUNK_LOGIT_BYTES / 2 ** 20:.0f} MiB of logits; measured "
          f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; model {flops / 1e12:.1f} TFLOP/step")
    print(f"{'backend':<8}{'loss':>10}{'fused':>6}{'median ms':>10}{'min ms':>9}{'tokens/s':>11}{'MFU':>7}"
          f"{'peak GiB':>10}{'first s':>9}{'loss':>8}")
    for r in rows:
        r["tokens_per_s"] = tokens / (r["median_ms"] / 1e3)
        r["mfu"] = flops / (r["median_ms"] / 1e3) / peak
        print(f"{r['backend']:<8}{r['loss_variant']:>10}{r['fused']:>6}{r['median_ms']:>10.1f}{r['min_ms']:>9.1f}"
              f"{r['tokens_per_s']:>11.0f}{r['mfu']:>7.1%}{r['peak_mem_gib']:>10.1f}{r['first_step_s']:>9.1f}"
              f"{r['loss']:>8.4f}")
    print(peer_line(rows))


def peer_line(rows: list) -> str:
    """The table's last line: which row is the peer (SpecForge, measured in this process), or why none is."""
    peer = next((r for r in rows if r.get("peer")), None)
    if peer is not None:
        return (f"peer: the last row is SpecForge {peer_specforge.version()} (OnlineDFlashModel, same shapes and "
                f"batch, {peer['backend']} attention), measured in this process; its MFU uses our model's FLOP count")
    if peer_specforge.version() is None:
        return ("peer (SpecForge): not measured: not importable here (carry its wheel in .whl/; "
                "bench/gpu/env.sh installs it with --no-deps)")
    return "peer (SpecForge): not measured: --no-peer"


def parse_args(argv=None):
    """Command line; `--loss both` expands to every loss variant."""
    ap = common.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", default=None, help="comma-separated; default flex,dense (dense with --tiny)")
    ap.add_argument("--loss", default="chunked", help="unchunked, chunked, fused (comma-separated) or both")
    ap.add_argument("--fused", choices=("on", "off", "both"), default="on",
                    help="dflash.fused kernels (CUDA only): on (default, as trained), off, or both rows")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU, dense: smoke-tests this script")
    ap.add_argument("--no-peer", action="store_true", help="leave out SpecForge's row even when it is importable")
    args = ap.parse_args(argv)
    args.losses = list(LOSSES) if args.loss == "both" else args.loss.split(",")
    bad = [v for v in args.losses if v not in LOSSES]
    if bad:
        ap.error(f"--loss: unknown variant {bad[0]!r} (choose from {', '.join(LOSSES)} or both)")
    args.fused_variants = {"on": [True], "off": [False], "both": [False, True]}[args.fused]
    args.backends = (args.backends or ("dense" if args.tiny else "flex,dense")).split(",")
    return args


def main(argv=None) -> int:
    """Measure every (backend, loss) row, print the table, write $OUT/bench_drafter.json; exit code."""
    args = parse_args(argv)
    if args.tiny:
        device, shape, peak = torch.device("cpu"), TINY, matmul_peak_flops(torch.device("cpu"), 256, 5)
        lm_loss.CHUNK_LOGIT_BYTES = 2 ** 20
    elif not torch.cuda.is_available():
        print("bench_drafter: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    else:
        device, shape = torch.device("cuda"), QWEN3_8B
        peak = matmul_peak_flops(device)
    packed = make_batch(device, shape)
    flops = model_flops(packed, device, shape)
    rows = [time_variant(b, v, f, packed, shape, args.repeats, args.warmup, device)
            for b in args.backends for v in args.losses for f in args.fused_variants]
    if not args.no_peer and peer_specforge.version() is not None:
        rows.append(peer_specforge.time_peer(packed, shape, args.repeats, args.warmup, device, sync))
    print_rows(rows, shape, packed.num_tokens, flops, peak)
    peer_ms = next((r["median_ms"] for r in rows if r.get("peer")), None)
    common.write_out("bench_drafter.json", {"peak_flops": peak, "model_flops": flops, "tokens": packed.num_tokens,
                                            "peer_ms": peer_ms, "chunk_logit_bytes": lm_loss.CHUNK_LOGIT_BYTES,
                                            "tiny": args.tiny, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
