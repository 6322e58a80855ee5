"""dflash.model + dflash.attention: reference names, mask semantics by perturbation, flex == dense."""

import pytest
import torch
from torch import nn
from transformers import Qwen3Config

from dflash import attention
from dflash.attention import MaskSet, build_layout, dense_mask, flex_block_mask, make_mask_mod, tile_block_mask
from dflash.model import DFlashConfig, DFlashDraftModel, draft_config_for_target

H, K, BS, V = 32, 3, 4, 64
TARGET = Qwen3Config(hidden_size=H, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=V)
# two documents: flat 0..19 (doc 0) and 20..49 (doc 1)
DOC = torch.tensor([0] * 20 + [1] * 30, dtype=torch.int32)
POS = torch.cat([torch.arange(20), torch.arange(30)])
ANCHORS = torch.tensor([3, 12, 25, 30, 41])


def _head(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(V, H, generator=g))
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.2)
    return emb, head


def _drafter(backend="dense", window=None, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = draft_config_for_target(TARGET, layers, BS, [1, 3, 5], V - 1, sliding_window=window,
                                  attn_backend=backend)
    return DFlashDraftModel(cfg, *_head())


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(50, K * H, generator=g)
    block = torch.full((len(ANCHORS), BS), V - 1)
    block[:, 0] = torch.randint(0, V - 1, (len(ANCHORS),), generator=g)
    lay = build_layout(DOC, POS, DOC[ANCHORS], ANCHORS, POS[ANCHORS], BS)
    return ctx, block, lay


def _blocks(model, ctx, block, lay):
    with torch.no_grad():
        return model(ctx, block, lay)[: len(ANCHORS) * BS].view(len(ANCHORS), BS, H)


def test_state_dict_names_follow_reference():
    model = _drafter(layers=2)
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"] + [
        f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    sd = model.state_dict()
    assert set(sd) == expected
    assert sd["fc.weight"].shape == (H, K * H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (2 * TARGET.head_dim, H)
    # the frozen head is used but neither trained nor saved
    assert all(p.requires_grad for p in model.parameters())
    assert not model.head.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_mask_semantics_by_perturbation(backend):
    model = _drafter(backend)
    ctx, block, lay = _inputs()
    base = _blocks(model, ctx, block, lay)
    j, a = 3, 30  # anchor 30: document 1, position 10

    def changed(ctx2=None, block2=None):
        out = _blocks(model, ctx if ctx2 is None else ctx2, block if block2 is None else block2, lay)
        return not torch.allclose(out[j], base[j], atol=1e-6, rtol=0)

    later = ctx.clone()
    later[a:] += 3.0                      # context at a and after (same doc, doc end)
    other_doc = ctx.clone()
    other_doc[:20] += 3.0             # every token of the other document
    other_blocks = block.clone()
    other_blocks[[0, 1, 2, 4], 0] = (block[[0, 1, 2, 4], 0] + 1) % (V - 1)
    assert not changed(ctx2=later)
    assert not changed(ctx2=other_doc)
    assert not changed(block2=other_blocks)
    before = ctx.clone()
    before[a - 1] += 3.0
    first = ctx.clone()
    first[20] += 3.0
    own = block.clone()
    own[j, 0] = (block[j, 0] + 1) % (V - 1)
    assert changed(ctx2=before) and changed(ctx2=first) and changed(block2=own)


def test_sliding_window_limits_context():
    model = _drafter("dense", window=6)
    ctx, block, lay = _inputs()
    base = _blocks(model, ctx, block, lay)
    j, a = 4, 41  # position 21 in doc 1: block queries at 21..24 see positions > 21+k-6
    far = ctx.clone()
    far[a - 6] += 3.0                       # position 15: outside every query's window
    near = ctx.clone()
    near[a - 2] += 3.0
    out_far, out_near = _blocks(model, far, block, lay), _blocks(model, near, block, lay)
    torch.testing.assert_close(out_far[j], base[j], atol=1e-6, rtol=0)
    assert not torch.allclose(out_near[j], base[j], atol=1e-6, rtol=0)


def test_dense_mask_rows():
    lay = build_layout(DOC, POS, DOC[ANCHORS], ANCHORS, POS[ANCHORS], BS)
    m = dense_mask(lay, None)
    np_ = lay.num_ctx_padded
    assert m.shape == (lay.num_queries, np_ + lay.num_queries)
    row = m[3 * BS + 2]                                        # anchor 30, block position 2
    assert row[:np_].nonzero().squeeze(1).tolist() == list(range(20, 30))
    assert row[np_:].nonzero().squeeze(1).tolist() == list(range(3 * BS, 4 * BS))
    assert m.any(dim=1).all()                                  # padding rows are never fully masked


def _random_layout(n, m, block_size, seed, docs):
    """`docs` documents of random lengths over n context tokens, m sorted anchors among them."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[:docs - 1] + 1).values
    doc = torch.bucketize(torch.arange(n), cuts, right=True).to(torch.int32)
    pos = torch.arange(n) - torch.cat([torch.tensor([0]), cuts])[doc.long()]
    anchors = torch.sort(torch.randperm(n - 1, generator=g)[:m] + 1).values
    return build_layout(doc, pos, doc[anchors], anchors, pos[anchors], block_size)


BLOCK_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("block_size,window", [(2, None), (16, None), (16, 1), (16, 40), (32, 17), (128, None),
                                               (128, 100), (64, 4000)])
def test_tile_block_mask_is_the_block_mask_create_block_mask_builds(block_size, window, monkeypatch):
    """Read off the tables, the BlockMask equals torch's (every tensor with its strides, the full tiles
    included, and every other attribute) over one, two and five documents, a batch of one anchor, and
    in chunks of one block-key pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    for i, (n, m, docs) in enumerate([(40, 1, 1), (700, 41, 2), (1500, 90, 5)]):
        lay = _random_layout(n, min(m, 2048 // block_size), block_size, seed=i, docs=docs)
        mod = make_mask_mod(lay, window)
        want = create_block_mask(mod, None, None, lay.num_queries, lay.kv_doc.shape[0], device="cpu")
        monkeypatch.setattr(attention, "TILE_CHUNK_ELEMS", 1 if i == 2 else 1 << 24)
        got = tile_block_mask(lay, window, mod)
        for name in BLOCK_MASK_TENSORS:
            a, b = getattr(got, name), getattr(want, name)
            assert torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride(), (name, n, m)
        others = {k: v for k, v in vars(want).items() if not isinstance(v, torch.Tensor)}
        assert {k: v for k, v in vars(got).items() if not isinstance(v, torch.Tensor)} == others
        assert got.mask_mod is mod


def test_a_block_size_that_does_not_divide_the_tile_builds_its_mask_with_create_block_mask():
    """Block 12: query tiles split blocks, so the mask_mod is evaluated (eager here); flex still equals dense."""
    lay = _random_layout(300, 20, 12, seed=3, docs=2)
    got = flex_block_mask(lay, 7, compile=False)
    assert lay.num_queries % 128 == 0 and got.seq_lengths == (lay.num_queries, lay.kv_doc.shape[0])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, lay.num_queries, 16, generator=g)
    k, v = (torch.randn(1, 2, lay.kv_doc.shape[0], 16, generator=g) for _ in range(2))
    flex, dense = MaskSet(lay, "flex", {7}), MaskSet(lay, "dense", {7})
    torch.testing.assert_close(flex.attend(q, k, v, 0.25, 7), dense.attend(q, k, v, 0.25, 7), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6, 3])
def test_flex_equals_dense_on_cpu(window):
    dense = _drafter("dense", window)
    flex = _drafter("flex", window)
    flex.load_state_dict(dense.state_dict())
    ctx, block, lay = _inputs(1)
    torch.testing.assert_close(_blocks(flex, ctx, block, lay), _blocks(dense, ctx, block, lay),
                               atol=2e-5, rtol=1e-5)


def test_batched_blocks_equal_single_inference_step():
    """Each block of a packed forward equals a decoding step with only its document's prefix."""
    model = _drafter("dense", window=7)
    ctx, block, lay = _inputs(2)
    batched = _blocks(model, ctx, block, lay)
    for j, a in enumerate(ANCHORS.tolist()):
        start = 0 if a < 20 else 20
        n = a - start
        single = build_layout(torch.zeros(n, dtype=torch.int32), torch.arange(n),
                              torch.zeros(1, dtype=torch.int32), torch.tensor([n]), torch.tensor([n]), BS)
        with torch.no_grad():
            out = model(ctx[start:a], block[j:j + 1], single)[:BS]
        torch.testing.assert_close(out, batched[j], atol=1e-5, rtol=1e-5)


def test_backward_reaches_drafter_not_head():
    model = _drafter("dense")
    ctx, block, lay = _inputs()
    out = model(ctx, block, lay)
    model.logits(out).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert model.head.lm_head.weight.grad is None


def test_config_validation_and_json_round_trip():
    cfg = draft_config_for_target(TARGET, 2, BS, [1, 3, 5], V - 1, sliding_window=6)
    d = cfg.to_json_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["num_target_layers"] == 8
    assert d["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 3, 5], "block_size": BS}
    assert d["layer_types"] == ["sliding_attention"] * 2 and d["sliding_window"] == 6
    assert "attn_backend" not in d
    back = DFlashConfig.from_json_dict(d)
    assert back == cfg
    with pytest.raises(ValueError, match="attn_backend"):
        draft_config_for_target(TARGET, 2, BS, [1], 0, attn_backend="fast")
    with pytest.raises(ValueError, match="sliding_window"):
        DFlashConfig(**{**back.__dict__, "sliding_window": None})
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig(**{**back.__dict__, "block_size": 1})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 6])
def test_cuda_flex_equals_dense_forward_and_backward(window):
    dense = _drafter("dense", window).cuda()
    flex = _drafter("flex", window).cuda()
    flex.load_state_dict(dense.state_dict())
    for m in (dense, flex):
        m.head.embed_tokens.cuda()
        m.head.lm_head.cuda()
    ctx, block, _ = _inputs(3)
    ctx, block = ctx.cuda(), block.cuda()
    lay = build_layout(DOC.cuda(), POS.cuda(), DOC[ANCHORS].cuda(), ANCHORS.cuda(), POS[ANCHORS].cuda(), BS)
    outs = []
    for m in (dense, flex):
        out = m(ctx, block, lay)
        out.square().sum().backward()
        outs.append((out.detach(), m.fc.weight.grad.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-3, rtol=1e-3)
