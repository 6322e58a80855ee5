"""dflash.pack: padding dropped, layout vs a naive reference, split == concat bitwise, noise."""

import pytest
import torch

from dflash.data import Batch
from dflash.pack import PackedBatch, pack_hidden


def _batch(lengths, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    am = torch.zeros(b, t, dtype=torch.int64)
    for i, n in enumerate(lengths):
        am[i, :n] = 1
    ids = torch.randint(0, 100, (b, t), generator=g) * am
    lm = (torch.rand(b, t, generator=g) > 0.3).to(torch.int64) * am
    return Batch(input_ids=ids, attention_mask=am, loss_mask=lm, num_tokens=int(am.sum()))


def _layers(b, t, k=3, h=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(b, t, h, generator=g).to(dtype) for _ in range(k)]


def _naive(layers, batch):
    rows = []
    for r in range(batch.attention_mask.shape[0]):
        for c in range(batch.attention_mask.shape[1]):
            if batch.attention_mask[r, c]:
                rows.append((r, c, torch.cat([layer[r, c] for layer in layers])))
    return rows


def test_concat_matches_naive_and_drops_padding():
    batch = _batch([12, 5, 9])
    layers = _layers(3, 12)
    p = pack_hidden(layers, batch, 0.0, 0, split=False)
    naive = _naive(layers, batch)
    assert p.hidden.shape == (26, 24) and p.num_tokens == 26 == batch.num_tokens
    torch.testing.assert_close(p.hidden, torch.stack([h for _, _, h in naive]), rtol=0, atol=0)
    assert p.doc_ids.tolist() == [r for r, _, _ in naive] and p.doc_ids.dtype == torch.int32
    assert p.position_ids.tolist() == [c for _, c, _ in naive]
    assert p.input_ids.tolist() == [int(batch.input_ids[r, c]) for r, c, _ in naive]
    assert p.loss_mask.dtype == torch.bool
    assert p.loss_mask.tolist() == [bool(batch.loss_mask[r, c]) for r, c, _ in naive]
    assert p.context(0.0) is p.hidden


def test_split_layout_and_context_equal_concat():
    batch = _batch([4, 12])
    layers = _layers(2, 12, k=4)
    c = pack_hidden(layers, batch, 0.0, 0, split=False)
    s = pack_hidden(layers, batch, 0.0, 0, split=True)
    assert s.hidden.shape == (4, 16, 8)
    torch.testing.assert_close(s.hidden[2], layers[2][batch.attention_mask.bool()], rtol=0, atol=0)
    assert torch.equal(s.context(0.0), c.hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_and_concat_bitwise_identical_with_noise(dtype):
    batch = _batch([12, 7, 3])
    layers = _layers(3, 12, dtype=dtype)
    c = pack_hidden(layers, batch, 0.05, 1234, split=False)
    s = pack_hidden(layers, batch, 0.05, 1234, split=True)
    sc = s.context(0.05)
    assert sc.dtype == dtype and torch.equal(sc, c.hidden)
    clean = pack_hidden(layers, batch, 0.0, 1234, split=False).hidden
    diff = (c.hidden.float() - clean.float()).abs()
    assert diff.max() <= 0.05 * 1.01 + (0.02 if dtype == torch.bfloat16 else 0) and diff.max() > 0.01
    other = pack_hidden(layers, batch, 0.05, 99, split=False).hidden
    assert not torch.equal(other, c.hidden)
    assert torch.equal(s.context(0.05), sc)  # context() does not mutate the shipped layers


def test_cpu_meta_kept_and_transfer_round_trip():
    batch = _batch([3, 12])
    p = pack_hidden(_layers(2, 12), batch, 0.0, 5, split=True)
    meta = p.meta()
    assert set(meta) == {"input_ids", "position_ids", "doc_ids", "loss_mask"}
    assert all(v.device.type == "cpu" for v in meta.values())
    rows, header = p.to_wire(batch_index=9)
    assert rows.dtype == torch.int64 and rows.shape == (4, p.num_tokens)
    assert header.batch_index == 9 and header.noise_seed == 5 and header.split == 1
    r, got = PackedBatch.from_wire(p.hidden, rows, list(header), device="cpu")   # as received
    assert got == header
    assert r.doc_ids.dtype == torch.int32 and r.loss_mask.dtype == torch.bool and r.split and r.noise_seed == 5
    assert torch.equal(r.loss_mask, p.loss_mask) and torch.equal(r.position_ids, p.position_ids)
    assert r.cpu["loss_mask"].dtype == torch.bool and torch.equal(r.context(0.1), p.context(0.1))
    with pytest.raises(ValueError, match="3 metadata rows"):
        PackedBatch.from_wire(p.hidden, rows[:3], list(header), device="cpu")


def test_bad_inputs():
    batch = _batch([3, 4])
    with pytest.raises(ValueError, match="does not match"):
        pack_hidden(_layers(3, 12), batch, 0.0, 0, split=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pack_matches_cpu_and_split_equals_concat():
    batch = _batch([12, 9, 1], t=12)
    layers = _layers(3, 12, k=5, h=64, dtype=torch.bfloat16)
    cpu = pack_hidden(layers, batch, 0.0, 0, split=False)
    dev = [x.cuda() for x in layers]
    c = pack_hidden(dev, batch, 0.0, 0, split=False)
    assert torch.equal(c.hidden.cpu(), cpu.hidden) and torch.equal(c.doc_ids.cpu(), cpu.doc_ids)
    c = pack_hidden(dev, batch, 0.1, 3, split=False)
    s = pack_hidden(dev, batch, 0.1, 3, split=True)
    assert torch.equal(s.context(0.1), c.hidden)
