"""dflash.flops: the drafter's step FLOPs equal bench_drafter's model_flops; pairs equal the dense mask's; both the
drafter's fwd+bwd and the target's forward equal torch's FlopCounterMode on real CPU runs, once the convention's
documented differences are taken out term by term:

- the counter counts what ran: the dense [Q, KV] attention matrix (SDPA's math backend, forced here: the CPU's
  fused kernel has no flop formula, so the counter would see no attention at all), and every padded row (the
  drafter's layout pads the context to Np and the blocks to Mp*B; the target's batch is right-padded);
- our convention counts masked-in pairs and real rows only.
Weight-grad of the frozen LM head and input-grad of fc are absent from both (autograd forms neither), so they
are not a difference."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.attention import build_layout, dense_mask
from dflash.flops import (causal_pairs, drafter_attention_pairs, drafter_flops, drafter_lm_rows, drafter_step_flops,
                          target_forward_flops)
from profiler.floors import compute_peaks, measure_matmul_flops_per_s, peak_flops_per_s
from dflash.loss import block_targets, compute_loss, sample_anchors
from dflash.model import DFlashDraftModel, draft_config_for_target
from dflash.pack import PackedBatch
from dflash.target import TargetCapture

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_drafter  # noqa: E402

CPU = torch.device("cpu")
TINY = bench_drafter.TINY


def _ragged(lengths, vocab, k_hidden, seed=0) -> PackedBatch:
    """Packed documents of the given lengths, a random loss mask with each document's first tokens a prompt."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    n = doc.shape[0]
    ids = torch.randint(0, vocab - 1, (n,), generator=g)
    lm = (torch.rand(n, generator=g) > 0.2) & (pos >= 3)
    meta = {"input_ids": ids, "position_ids": pos, "doc_ids": doc, "loss_mask": lm}
    return PackedBatch(torch.randn(n, k_hidden, generator=g), ids, pos, doc, lm, 0, False, meta)


def _anchors(packed: PackedBatch, per_doc: int, seed=0) -> torch.Tensor:
    meta = packed.meta()
    return sample_anchors(meta["loss_mask"], meta["doc_ids"], per_doc, torch.Generator().manual_seed(seed))


def _counted(model, packed, per_doc: int) -> dict:
    """FlopCounterMode's counts per op of one compute_loss + backward, SDPA on its math backend (bmm)."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        out = compute_loss(model, packed, packed.context(0.0), per_doc, 7.0, torch.Generator().manual_seed(0))
        out.loss.backward()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()} | {"num_targets": out.num_targets}


# --------------------------------------------------------------------------------------------------- drafter
def test_drafter_step_flops_equal_bench_drafter_model_flops():
    cfg = bench_drafter.build_model("dense", CPU, TINY, False).config
    for packed in (bench_drafter.make_batch(CPU, TINY), _ragged([100, 37, 5, 140], TINY.vocab, 2 * TINY.hidden)):
        want = bench_drafter.model_flops(packed, CPU, TINY)   # materialises the dense mask
        anchors = _anchors(packed, TINY.anchors)
        assert drafter_step_flops(cfg, packed.meta(), anchors) == pytest.approx(want, rel=1e-12)
    # LossOutput.num_targets given instead of counted: the same figure.
    rows = drafter_lm_rows(anchors, packed.meta()["doc_ids"], packed.meta()["loss_mask"], TINY.block)
    assert drafter_step_flops(cfg, packed.meta(), anchors, rows) == pytest.approx(want, rel=1e-12)
    assert drafter_step_flops(cfg, packed.meta(), anchors[:0]) == 0.0   # no anchors: compute_loss runs no model


@pytest.mark.parametrize("window", [None, 1, 3, 16, 40, 1000])
@pytest.mark.parametrize("block", [4, 16])
def test_pairs_equal_the_dense_masks_true_entries(window, block):
    packed = _ragged([50, 3, 77, 20, 64], 100, 8, seed=block)
    meta = packed.meta()
    anchors = _anchors(packed, 6, seed=1)
    assert anchors.numel() > 10
    lay = build_layout(meta["doc_ids"], meta["position_ids"], meta["doc_ids"][anchors], anchors,
                       meta["position_ids"][anchors], block)
    want = int(dense_mask(lay, window)[: anchors.numel() * block].sum())
    assert drafter_attention_pairs(anchors, meta["doc_ids"], meta["position_ids"], block, window) == want
    assert drafter_attention_pairs(anchors[:0], meta["doc_ids"], meta["position_ids"], block, window) == 0


def test_lm_rows_equal_block_targets_valid_count():
    packed = _ragged([30, 2, 41, 9], 100, 8)
    meta = packed.meta()
    anchors = _anchors(packed, 5)
    for bs in (2, 4, 16):
        _, valid = block_targets(anchors, meta["loss_mask"], meta["doc_ids"], bs)
        assert drafter_lm_rows(anchors, meta["doc_ids"], meta["loss_mask"], bs) == int(valid.sum())


def test_drafter_flops_equal_the_flop_counter_on_an_unpadded_batch():
    """TINY: 2 x 128 tokens and 16 anchors of block 16 fill whole 128-row tiles, so nothing is padded: the only
    difference is attention's dense matrix (counted by the counter) against its masked-in pairs (ours)."""
    model = bench_drafter.build_model("dense", CPU, TINY, False)
    cfg, packed = model.config, bench_drafter.make_batch(CPU, TINY)
    meta, anchors = packed.meta(), _anchors(packed, TINY.anchors)
    n, q = packed.num_tokens, anchors.numel() * TINY.block
    assert n % 128 == 0 and q % 128 == 0 and q >= 256     # no padding in the layout (dflash.attention)
    counts = _counted(model, packed, TINY.anchors)
    pairs = drafter_attention_pairs(anchors, meta["doc_ids"], meta["position_ids"], TINY.block)
    attn_per_pair = 3 * 4 * TINY.heads * TINY.head_dim * TINY.layers         # fwd+bwd, QK^T and PV, all layers
    ours = drafter_step_flops(cfg, meta, anchors)
    assert counts["aten.mm"] == ours - attn_per_pair * pairs             # every projection, fc and the head
    assert counts["aten.bmm"] == attn_per_pair * q * (n + q)             # the dense matrix the kernel computes
    assert pairs < q * (n + q) // 2                                      # ... which the mask mostly hides


def test_drafter_flops_equal_the_flop_counter_on_a_padded_sliding_batch():
    """Ragged documents, 9 anchors (padded to 32 blocks of 8: two 128-row query tiles at least), 300 context
    tokens (padded to 384), sliding layers:
    the counter counts every padded row of the projections and MLP (but fc, which runs before the padding) and
    the dense attention matrix; from those counts drafter_flops gives its figure exactly."""
    h, vocab = 32, 96
    target = Qwen3Config(hidden_size=h, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=vocab)
    cfg = draft_config_for_target(target, 2, 8, [1, 3], vocab - 1, sliding_window=12, attn_backend="dense")
    torch.manual_seed(0)
    model = DFlashDraftModel(cfg, nn.Embedding(vocab, h), nn.Linear(h, vocab, bias=False), False)
    packed = _ragged([150, 90, 60], vocab, 2 * h)
    anchors = _anchors(packed, 3)
    n, m, bs = packed.num_tokens, anchors.numel(), cfg.block_size
    np_, qp = 384, 256                                 # dflash.attention's padding of 300 tokens, 9 blocks of 8
    assert (n, m) == (300, 9)
    meta = packed.meta()
    lay = build_layout(meta["doc_ids"], meta["position_ids"], meta["doc_ids"][anchors], anchors,
                       meta["position_ids"][anchors], bs)
    assert (lay.num_ctx_padded, lay.num_queries) == (np_, qp)
    counts = _counted(model, packed, 3)
    rows = counts["num_targets"]
    assert rows == drafter_lm_rows(anchors, meta["doc_ids"], meta["loss_mask"], bs)
    fc_on_padding = 2 * 2 * (np_ - n) * len(cfg.target_layer_ids) * h * h
    assert counts["aten.mm"] == drafter_flops(cfg, np_, qp, 0, rows) - fc_on_padding
    assert counts["aten.bmm"] == drafter_flops(cfg, 0, 0, qp * (np_ + qp), 0)
    # Our figure: the same matmuls on real rows and masked-in (windowed) pairs.
    pairs = drafter_attention_pairs(anchors, meta["doc_ids"], meta["position_ids"], bs, 12)
    assert drafter_step_flops(cfg, meta, anchors) == drafter_flops(cfg, n, m * bs, pairs, rows)


def test_host_metadata_only():
    """A device tensor is refused rather than read (reading one would sync); "meta" stands in for CUDA here."""
    packed = _ragged([20, 20], 50, 8)
    meta = packed.meta()
    anchors = _anchors(packed, 2)
    with pytest.raises(ValueError, match="CPU tensor"):
        drafter_attention_pairs(anchors.to("meta"), meta["doc_ids"], meta["position_ids"], 4)
    with pytest.raises(ValueError, match="CPU tensor"):
        causal_pairs(torch.tensor([3, 4], device="meta"))
    with pytest.raises(ValueError, match="non-decreasing"):
        drafter_attention_pairs(anchors, meta["doc_ids"].flip(0), meta["position_ids"], 4)


# ---------------------------------------------------------------------------------------------------- target
def _target(**extra) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=32, intermediate_size=72, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=120, **extra)
    return Qwen3ForCausalLM(cfg).eval()


def _right_padded(lengths, vocab):
    t = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), t), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
    return ids, mask


def _count(fn) -> dict:
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        fn()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_target_forward_flops_equal_the_flop_counter():
    """TargetCapture runs layers 0..5 of 8 and no LM head; the counter also counts the right padding's rows
    and the dense [T, T] attention matrix of every row, where ours counts real tokens and causal pairs."""
    model = _target()
    c = model.config
    lengths = [19, 7, 12]
    ids, mask = _right_padded(lengths, c.vocab_size)
    b, t = ids.shape
    cap = TargetCapture(model, [1, 3, 5])
    counts = _count(lambda: cap(ids, mask))
    run, hd = 6, c.num_attention_heads * c.head_dim
    per_token = 2 * c.hidden_size * (2 * hd + 2 * c.num_key_value_heads * c.head_dim + 3 * c.intermediate_size)
    padding = b * t - sum(lengths)
    dense_minus_causal = b * t * t - sum(n * (n + 1) // 2 for n in lengths)
    ours = target_forward_flops(c, mask.sum(1), cap.layer_ids)
    assert counts["aten.mm"] == ours - run * 4 * hd * causal_pairs(mask.sum(1)) + run * padding * per_token
    assert counts["aten.bmm"] == run * 4 * hd * b * t * t
    assert sum(counts.values()) == ours + run * (padding * per_token + 4 * hd * dense_minus_causal)
    # The whole model with its LM head (a plain forward): all 8 layers and the head on every position.
    full = _count(lambda: model(input_ids=ids, attention_mask=mask))
    ours_full = target_forward_flops(c, lengths, [7], lm_head=True)
    head_on_padding = 2 * padding * c.hidden_size * c.vocab_size
    assert sum(full.values()) == ours_full + 8 * (padding * per_token + 4 * hd * dense_minus_causal) + head_on_padding
    assert ours_full > ours


def test_causal_pairs_with_and_without_a_window_equal_the_mask():
    lengths = torch.tensor([1, 5, 17, 33])
    for window in (None, 1, 4, 17, 100):
        want = 0
        for n in lengths.tolist():
            i = torch.arange(n)
            seen = i[None, :] <= i[:, None]
            if window is not None:
                seen &= i[:, None] - i[None, :] < window          # transformers' sliding-window overlay
            want += int(seen.sum())
        assert causal_pairs(lengths, window) == want


def test_target_sliding_layers_count_their_window():
    c = _target(use_sliding_window=True, sliding_window=4, max_window_layers=2).config
    assert c.layer_types[:3] == ["full_attention", "full_attention", "sliding_attention"]
    lengths = [10, 3]
    hd = c.num_attention_heads * c.head_dim
    full = target_forward_flops(_target().config, lengths, [4])
    windowed_out = causal_pairs(lengths) - causal_pairs(lengths, 4)      # layers 2..4 are sliding
    assert target_forward_flops(c, lengths, [4]) == full - 3 * 4 * hd * windowed_out


# ------------------------------------------------------------------------------------------------------ peak
@pytest.mark.parametrize("name, flops_per_s", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H200", 989.4e12), ("NVIDIA H100 SXM5 80GB", 989.4e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None), ("NVIDIA L4", None), ("Tesla V100-SXM2-16GB", None)])
def test_datasheet_peaks(name, flops_per_s):
    got = peak_flops_per_s(name)
    if flops_per_s is None:
        assert got is None
    else:
        assert got[0] == flops_per_s and got[1].startswith("datasheet dense bf16")
    assert peak_flops_per_s("NVIDIA H200")[1] == "datasheet dense bf16 (H100/H200 SXM)"


def test_measured_matmul_rate_is_positive_on_cpu():
    assert measure_matmul_flops_per_s(CPU, n=64, iters=2, dtype=torch.float32) > 0


def test_a_cpu_rank_has_a_measured_peak_and_no_datasheet():
    peaks = compute_peaks(CPU, "x86_64")
    assert set(peaks) == {"measured"} and peaks["measured"]["flops_per_s"] > 0
    assert peaks["measured"]["what"].startswith("float32 256x256x256 matmul")
