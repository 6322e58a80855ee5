"""dflash.lm_loss: the chunked linear + cross entropy against the unchunked computation it replaced
(loss, correct flags, d/d hidden, d/d drafter parameters), for chunk sizes from one row to more than
all rows, fp32 and bf16, eager and fused; the frozen head gets no gradient."""

import pytest
import torch
from torch import nn
from transformers import Qwen3Config

import dflash.loss as loss_mod
from dflash import lm_loss
from dflash.lm_loss import chunk_rows_for, linear_cross_entropy, reference_linear_cross_entropy
from dflash.loss import compute_loss
from dflash.model import DFlashDraftModel, draft_config_for_target
from dflash.pack import PackedBatch

ROWS, WIDTH, VOCAB = 37, 16, 50
H, K, BS, V = 32, 2, 4, 48   # the drafter of the compute_loss tests
CHUNKS = [1, 4, 5, 36, ROWS, ROWS + 1, 1000]   # 5 and 36 leave a ragged last chunk


def _case(seed=0, dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(WIDTH, VOCAB, bias=bias).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, WIDTH, generator=g))
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=g))
    head = head.to(dtype)
    hidden = torch.randn(ROWS, WIDTH, generator=g)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    # Make a third of the rows predict their target, so the correct flags are not all False.
    targets[::3] = (hidden[::3].to(dtype) @ head.weight.T).float().argmax(-1)
    row_weight = torch.rand(ROWS, generator=g) + 0.1
    return hidden, head, targets, row_weight, float(row_weight.double().sum()) * 1.25


def _run(fn, hidden, head, targets, row_weight, total, grad_scale=1.0, **kw):
    h = hidden.clone().requires_grad_(True)
    loss, correct = fn(h, head.weight, head.bias, targets, row_weight, total, **kw)
    (loss * grad_scale).backward()
    return loss.detach(), correct, h.grad


@pytest.mark.parametrize("bias", [False, True])
def test_matches_unchunked_for_every_chunk_size_fp32(bias):
    case = _case(1, bias=bias)
    ref_loss, ref_correct, ref_grad = _run(reference_linear_cross_entropy, *case, grad_scale=3.5)
    assert 0 < int(ref_correct.sum()) < ROWS
    for rows in CHUNKS:
        loss, correct, grad = _run(linear_cross_entropy, *case, grad_scale=3.5, chunk_rows=rows)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        assert torch.equal(correct, ref_correct), rows
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
        assert case[1].weight.grad is None


def test_bf16_head_matches_unchunked():
    """bf16 head and bf16 hidden (the benchmark's setup) and fp32 hidden into a bf16 head."""
    for hidden_dtype in (torch.bfloat16, torch.float32):
        hidden, head, targets, row_weight, total = _case(2, torch.bfloat16)
        hidden = hidden.to(hidden_dtype)
        ref = _run(reference_linear_cross_entropy, hidden, head, targets, row_weight, total)
        for rows in (1, 5, 1000):
            loss, correct, grad = _run(linear_cross_entropy, hidden, head, targets, row_weight, total,
                                       chunk_rows=rows)
            assert grad.dtype == hidden_dtype
            torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=0)
            assert torch.equal(correct, ref[1])
            torch.testing.assert_close(grad, ref[2], rtol=1e-2, atol=1e-5)


def test_cpu_autocast_matches_unchunked():
    """fp32 head under bf16 autocast: logits in bf16 as F.linear under autocast gives them."""
    hidden, head, targets, row_weight, total = _case(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(reference_linear_cross_entropy, hidden, head, targets, row_weight, total)
        for rows in (1, 5, 1000):
            loss, correct, grad = _run(linear_cross_entropy, hidden, head, targets, row_weight, total,
                                       chunk_rows=rows)
            assert grad.dtype == torch.float32
            torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=0)
            assert torch.equal(correct, ref[1])
            torch.testing.assert_close(grad, ref[2], rtol=1e-2, atol=1e-5)


def test_fused_math_matches_eager(monkeypatch):
    """The fused path's math (run uncompiled here; compiled in the slow test) equals the eager one."""
    monkeypatch.setattr(lm_loss, "_ce_grad_compiled", lm_loss._ce_grad_math)
    case = _case(4, bias=True)
    ref = _run(reference_linear_cross_entropy, *case)
    for rows in (1, 5, 1000):
        loss, correct, grad = _run(linear_cross_entropy, *case, chunk_rows=rows, fused=True)
        torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=0)
        assert torch.equal(correct, ref[1])
        torch.testing.assert_close(grad, ref[2], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fused_compiled_matches_unchunked_without_recompiling(monkeypatch):
    """torch.compile of the elementwise part (Inductor's C++ backend on the CPU), fp32 and a bf16
    head: the first call compiles, later chunk sizes (no 1-row chunk: Dynamo specialises 1) must not
    recompile."""
    monkeypatch.setattr(lm_loss, "_ce_grad_compiled", None)
    for dtype, grad_rtol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        case = _case(5, dtype)
        ref = _run(reference_linear_cross_entropy, *case)
        for i, rows in enumerate((8, 7, 10, 11)):   # 37 rows: last chunks of 5, 2, 7 and 4 rows
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                loss, correct, grad = _run(linear_cross_entropy, *case, chunk_rows=rows, fused=True)
            torch.testing.assert_close(loss, ref[0], rtol=1e-6, atol=0)
            assert torch.equal(correct, ref[1])
            torch.testing.assert_close(grad, ref[2], rtol=grad_rtol, atol=1e-5)


def test_no_grad_and_argument_checks():
    hidden, head, targets, row_weight, total = _case(6)
    ref_loss, ref_correct = reference_linear_cross_entropy(hidden, head.weight, None, targets, row_weight, total)
    with torch.no_grad():
        loss, correct = linear_cross_entropy(hidden.requires_grad_(True), head.weight, None, targets,
                                             row_weight, total, chunk_rows=4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert torch.equal(correct, ref_correct) and not loss.requires_grad
    with pytest.raises(ValueError, match="frozen"):
        linear_cross_entropy(hidden, head.weight.detach().requires_grad_(True), None, targets, row_weight, total)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, head.weight, None, targets[1:], row_weight, total)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(hidden, head.weight, None, targets, row_weight, total, chunk_rows=0)


def test_chunk_rows_from_byte_budget():
    assert chunk_rows_for(151_936, 2, 1 << 30) == 3533          # Qwen3 vocab, bf16, 1 GiB
    assert chunk_rows_for(151_936, 4, 1000) == 1                 # never zero rows
    assert chunk_rows_for(VOCAB, 4, VOCAB * 4 * 7) == 7


def _packed(seed):
    """Three documents of 9, 14 and 3 tokens, a random loss mask, random context features."""
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 14, 3]
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, V - 1, (len(doc),), generator=g)
    lm = torch.rand(len(doc), generator=g) > 0.25
    lm[:3] = False
    return PackedBatch(torch.randn(len(doc), K * H, generator=g), ids, pos, doc, lm, 0, False, None)


def _drafter():
    """A one-layer drafter with a frozen random embedding and LM head."""
    torch.manual_seed(0)
    target = Qwen3Config(hidden_size=H, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=V)
    return DFlashDraftModel(draft_config_for_target(target, 1, BS, [1, 3], V - 1),
                            nn.Embedding(V, H), nn.Linear(H, V, bias=False))


def _drafter_step(monkeypatch, fn, chunk_bytes, autocast=False):
    """compute_loss + backward on the test_loss drafter, with the head loss `fn` and chunk budget."""
    monkeypatch.setattr(loss_mod, "linear_cross_entropy", fn)
    monkeypatch.setattr(lm_loss, "CHUNK_LOGIT_BYTES", chunk_bytes)
    p, model = _packed(2), _drafter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = compute_loss(model, p, p.context(0.0), 4, 7.0, torch.Generator().manual_seed(0))
    out.loss.backward()
    assert model.head.lm_head.weight.grad is None
    grads = {n: q.grad for n, q in model.named_parameters()}
    return out, grads


@pytest.mark.parametrize("autocast", [False, True])
def test_compute_loss_matches_unchunked(monkeypatch, autocast):
    """Through the drafter: loss, acc, tau, tau_prefix and every parameter's gradient."""
    ref, ref_grads = _drafter_step(monkeypatch, reference_linear_cross_entropy, 1 << 30, autocast)
    assert ref.num_targets > 7
    tol = dict(rtol=1e-2, atol=1e-5) if autocast else dict(rtol=1e-5, atol=1e-7)
    for rows in (1, 7, ref.num_targets, ref.num_targets + 3):
        out, grads = _drafter_step(monkeypatch, linear_cross_entropy, rows * V * 4, autocast)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
        for name in ("acc", "tau", "tau_prefix"):
            assert torch.equal(getattr(out, name), getattr(ref, name)), name
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_bf16_autocast_no_sync(fused):
    """The trainer's CUDA setup (bf16 head, fp32 hidden, bf16 autocast), with sync debug mode set to
    error: no host-device sync in forward or backward, and the unchunked results."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, width, vocab = 1000, 256, 32_000
    head = nn.Linear(width, vocab, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(rows, width, device="cuda", generator=g)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    row_weight = torch.rand(rows, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = _run(reference_linear_cross_entropy, hidden, head, targets, row_weight, 400.0)
        _run(linear_cross_entropy, hidden, head, targets, row_weight, 400.0, chunk_rows=300, fused=fused)
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss, correct, grad = _run(linear_cross_entropy, hidden, head, targets, row_weight, 400.0,
                                       chunk_rows=300, fused=fused)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=0)
    assert float((correct != ref[1]).float().mean()) < 1e-3   # argmax of bf16 logits: rare ties
    torch.testing.assert_close(grad, ref[2], rtol=2e-2, atol=1e-6)
