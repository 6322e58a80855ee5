"""dflash.loss: anchor rules, weights/normalisation against a hand computation, acc/tau, gradients."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

from dflash.attention import build_layout
from dflash.loss import block_targets, compute_loss, position_weights, sample_anchors
from dflash.model import DFlashDraftModel, draft_config_for_target
from dflash.pack import PackedBatch

H, K, BS, V = 32, 2, 4, 48
TARGET = Qwen3Config(hidden_size=H, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=V)


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 14, 3]
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    n = len(doc)
    ids = torch.randint(0, V - 1, (n,), generator=g)
    lm = torch.rand(n, generator=g) > 0.25
    lm[:3] = False
    hidden = torch.randn(n, K * H, generator=g)
    return PackedBatch(hidden, ids, pos, doc, lm, 0, False, None)


def _drafter():
    torch.manual_seed(0)
    emb, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    return DFlashDraftModel(draft_config_for_target(TARGET, 1, BS, [1, 3], V - 1), emb, head)


def test_anchor_rules():
    p = _packed()
    lm, doc = p.loss_mask, p.doc_ids
    for num in (1, 2, 100):
        a = sample_anchors(lm, doc, num, torch.Generator().manual_seed(3))
        assert a.tolist() == sorted(set(a.tolist()))
        assert all(lm[i] and lm[i + 1] and doc[i] == doc[i + 1] for i in a.tolist())
        counts = torch.bincount(doc[a].long(), minlength=3)
        assert counts.max() <= num
    eligible = [i for i in range(len(lm) - 1) if lm[i] and lm[i + 1] and doc[i] == doc[i + 1]]
    assert a.tolist() == eligible  # num_anchors above the count: every eligible position
    one = sample_anchors(lm, doc, 2, torch.Generator().manual_seed(3))
    assert torch.equal(one, sample_anchors(lm, doc, 2, torch.Generator().manual_seed(3)))
    seen = {tuple(sample_anchors(lm, doc, 2, torch.Generator().manual_seed(s)).tolist()) for s in range(20)}
    assert len(seen) > 1  # random, not the first two
    assert sample_anchors(torch.zeros(5, dtype=torch.bool), torch.zeros(5, dtype=torch.int32), 4,
                          torch.Generator()).numel() == 0


def test_block_targets_validity():
    lm = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    doc = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.int32)
    idx, valid = block_targets(torch.tensor([0, 5, 6]), lm, doc, 4)
    assert valid.tolist() == [[True, True, False], [True, True, False], [True, False, False]]
    assert idx[0].tolist() == [1, 2, 3]


def test_loss_matches_hand_computation():
    p = _packed(1)
    model = _drafter()
    gamma = 2.5
    out = compute_loss(model, p, p.context(0.0), 3, gamma, torch.Generator().manual_seed(5))
    anchors = sample_anchors(p.loss_mask, p.doc_ids, 3, torch.Generator().manual_seed(5))
    assert out.num_anchors == len(anchors)
    block = torch.full((len(anchors), BS), V - 1)
    block[:, 0] = p.input_ids[anchors]
    lay = build_layout(p.doc_ids, p.position_ids, p.doc_ids[anchors], anchors, p.position_ids[anchors], BS)
    logits = model.logits(model(p.hidden, block, lay)[: len(anchors) * BS].view(len(anchors), BS, H))
    num, den = 0.0, 0.0
    hits, counts = [0] * (BS - 1), [0] * (BS - 1)
    n = len(p.input_ids)
    for j, a in enumerate(anchors.tolist()):
        for k in range(1, BS):
            t = a + k
            if t < n and p.doc_ids[t] == p.doc_ids[a] and p.loss_mask[t]:
                w = math.exp(-(k - 1) / gamma)
                num = num + w * F.cross_entropy(logits[j, k][None], p.input_ids[t][None])
                den += w
                counts[k - 1] += 1
                hits[k - 1] += int(logits[j, k].argmax() == p.input_ids[t])
    assert out.num_targets == sum(counts)
    torch.testing.assert_close(out.loss, num / den)
    acc = torch.tensor([h / c if c else 0.0 for h, c in zip(hits, counts)])
    torch.testing.assert_close(out.acc, acc)
    tau = 1 + sum(math.prod(acc[: i + 1].tolist()) for i in range(BS - 1))
    torch.testing.assert_close(out.tau, torch.tensor(tau))


def test_position_weights():
    torch.testing.assert_close(position_weights(4, 7.0),
                               torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)], dtype=torch.float64))


def test_gradients_and_empty_batch():
    p = _packed(2)
    model = _drafter()
    out = compute_loss(model, p, p.context(0.0), 4, 7.0, torch.Generator().manual_seed(0))
    out.loss.backward()
    assert all(q.grad is not None for q in model.parameters())
    assert model.head.lm_head.weight.grad is None
    empty = PackedBatch(p.hidden, p.input_ids, p.position_ids, p.doc_ids, torch.zeros_like(p.loss_mask), 0, False)
    out = compute_loss(model, empty, empty.context(0.0), 4, 7.0, torch.Generator())
    assert out.num_anchors == 0 and float(out.loss) == 0.0 and float(out.tau) == 1.0
    out.loss.backward()


def test_autocast_mixed_precision_step():
    """fp32 parameters under bf16 autocast (the trainer's CUDA setup), dense backend on the CPU."""
    p = _packed(3)
    model = _drafter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compute_loss(model, p, p.context(0.0), 4, 7.0, torch.Generator().manual_seed(0))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.fc.weight.grad.dtype == torch.float32


def test_tau_prefix_counts_each_anchors_leading_run_of_correct_predictions():
    """Two anchors: one right at every position, one wrong at the first. The independence formula
    (tau) and the per-anchor prefix (tau_prefix) differ exactly as hand-computed."""
    from types import SimpleNamespace

    import torch.nn as nn

    from dflash.loss import compute_loss
    from dflash.pack import PackedBatch

    bs, vocab = 4, 8
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5])
    doc = torch.tensor([0] * 6 + [1] * 6, dtype=torch.int32)
    pos = torch.cat([torch.arange(6), torch.arange(6)])
    lm = torch.ones(12, dtype=torch.bool)
    packed = PackedBatch(torch.zeros(12, 2), ids, pos, doc, lm, 0, False)

    class Oracle(nn.Module):
        """Predicts token[a+k] for anchor 0 and garbage at k=1 (then right) for the other anchor.
        Its block states are the logits themselves, read through an identity LM head."""
        block_size, mask_token_id = bs, 0

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))
            head = nn.Linear(vocab, vocab, bias=False).requires_grad_(False)
            head.weight.copy_(torch.eye(vocab))
            self.head = SimpleNamespace(lm_head=head)

        def forward(self, context, block, layout):
            n = block.shape[0] * bs
            out = torch.zeros(n, vocab)
            rows = torch.arange(n)
            anchor_of, k = rows // bs, rows % bs
            start = torch.stack([(ids == t).nonzero()[0, 0] for t in block[:, 0]])
            want = ids[(start[anchor_of] + k).clamp(max=len(ids) - 1)]
            want = torch.where((anchor_of == 1) & (k == 1), (want + 1) % vocab, want)
            out[rows, want] = 10.0
            return out + self.w

    import dflash.loss as L

    orig = L.sample_anchors
    L.sample_anchors = lambda *a, **k: torch.tensor([0, 6])
    try:
        out = compute_loss(Oracle(), packed, packed.hidden, 1, 7.0, torch.Generator().manual_seed(0))
    finally:
        L.sample_anchors = orig
    assert out.acc.tolist() == [0.5, 1.0, 1.0]
    assert float(out.tau) == pytest.approx(1 + 0.5 + 0.5 + 0.5)
    assert float(out.tau_prefix) == pytest.approx(1 + (3 + 0) / 2)
