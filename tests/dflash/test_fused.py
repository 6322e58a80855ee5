"""dflash.fused: the eager math is the HF code op for op; the torch.compile'd kernels (Inductor's C++
backend here, Triton on CUDA) match it forward and backward over several shapes with one compile per
dtype; and the drafter's fused path matches its eager path."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash import fused
from dflash.attention import build_layout
from dflash.model import DFlashDraftModel, draft_config_for_target

H, K, BS, V = 32, 3, 4, 64
"""The test drafter's hidden size, target layers, block size and vocabulary."""

BF16_ULP = 2.0 ** -7
"""Relative spacing of bf16 numbers (8 significand bits): one unit in the last place at 1.0."""

TOL = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.bfloat16: dict(rtol=BF16_ULP, atol=1e-5)}
"""Outputs and activation gradients. float32: reassociation of the mean and fused multiply-adds;
bf16: at most one ulp apart."""

WEIGHT_GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=BF16_ULP, atol=1e-4)}
"""Norm weight gradients: sums over up to 300 rows, whose order the compiled reduction changes."""


def _rand(g, *shape, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=g) * scale + shift).to(device=device, dtype=dtype).requires_grad_(True)


def _case(name: str, rows: int, dtype: torch.dtype, seed: int, device="cpu"):
    """Inputs of fused function `name` with `rows` rows, shaped and typed as the test drafter below
    passes them (hidden 32; 4 query and 2 key heads of width 16; norm weights are Parameters,
    activations require grad, cos/sin do not), so that the drafter tests reuse these graphs."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(dtype=dtype, device=device)
    weight = nn.Parameter(_rand(g, 16 if name == "qk_norm_rope" else H, scale=0.3, shift=1.0, **kw))
    if name == "rms_norm":
        return _rand(g, rows, H, **kw), weight, 1e-6
    if name == "add_rms_norm":
        return _rand(g, rows, H, **kw), _rand(g, rows, H, **kw), weight, 1e-6
    if name == "qk_norm_rope":
        kv = rows + 131                                    # context keys before the block keys
        pos = torch.randint(0, 5000, (kv, 1), generator=g).float()
        angle = pos * 10000.0 ** (-torch.arange(8) / 8)
        angle = torch.cat([angle, angle], -1)
        return (_rand(g, rows, 4, 16, scale=2.0, **kw), _rand(g, kv, 2, 16, scale=2.0, **kw), weight, 1e-6,
                nn.Parameter(_rand(g, 16, scale=0.3, shift=1.0, **kw)), 1e-6,
                angle.cos().to(**kw), angle.sin().to(**kw), dtype)
    return _rand(g, rows, 64, scale=3.0, **kw), _rand(g, rows, 64, **kw)


def _fwd_bwd(fn, args):
    """Outputs and the gradients of every floating input that requires grad, for a fixed cotangent."""
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    g = torch.Generator().manual_seed(99)
    cot = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, inputs, cot))


def test_math_is_the_hf_code():
    """The functions the kernels are compiled from equal the eager modules bit for bit."""
    g = torch.Generator().manual_seed(0)
    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                             (torch.bfloat16, torch.float32)):      # the last: autocast's mix
        norm = Qwen3RMSNorm(24, eps=1e-5).to(w_dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(7, 24, generator=g).to(x_dtype)
        assert torch.equal(fused.rms_norm_math(x, norm.weight, norm.variance_epsilon), norm(x))
    gate, up = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    assert torch.equal(fused.silu_mul_math(gate, up), ACT2FN["silu"](gate) * up)


def _check_compiled(name: str, device: str):
    """Per dtype: the first shape compiles, three more shapes run under error_on_recompile; forward
    outputs and input gradients agree with the eager math (float32 ~1e-6, bf16 within an ulp)."""
    fused._compiled.pop(name, None)
    graphs0 = counters["stats"]["unique_graphs"]
    for dtype in (torch.float32, torch.bfloat16):
        for i, rows in enumerate((37, 50, 91, 300)):
            args = _case(name, rows, dtype, seed=rows, device=device)
            ref = _fwd_bwd(fused._MATH[name], args)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = _fwd_bwd(fused.compiled(name), args)
            for r, c in zip(ref, got, strict=True):
                assert c.dtype == r.dtype and c.shape == r.shape
                torch.testing.assert_close(c, r, **(WEIGHT_GRAD_TOL if c.dim() == 1 else TOL)[dtype])
    # At most one graph per dtype (the backward is compiled with it); shapes alone added none (the
    # error_on_recompile above). Fewer when an earlier test compiled the same math for a dtype:
    # dynamo caches graphs on the function's code, across torch.compile wrappers.
    assert 1 <= counters["stats"]["unique_graphs"] - graphs0 <= 2


@pytest.mark.parametrize("name", list(fused._MATH))
def test_compiled_matches_eager_without_recompiling(name):
    _check_compiled(name, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(fused._MATH))
def test_cuda_compiled_matches_eager_without_recompiling(name):
    """The same through Triton."""
    _check_compiled(name, "cuda")


DRAFTER_TOL = {"fp32": dict(rtol=1e-4, atol=1e-5), "bf16": dict(rtol=2e-2, atol=2e-2),
               "autocast": dict(rtol=2e-2, atol=2e-3)}
"""Through 2 layers and the backward: float32 reassociation, or bf16 roundings that land on the
other side of a tie and propagate."""


def _drafter_case(seed: int, anchors: list[int], mode: str, device: str, fused_elementwise: bool = True):
    """A 2-layer drafter (non-trivial norm weights; bf16 parameters in mode "bf16"), its context,
    block ids and layout, on `device`."""
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=H, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=V)
    torch.manual_seed(seed)
    cfg = draft_config_for_target(target, 2, BS, [1, 3, 5], V - 1, attn_backend="dense")
    model = DFlashDraftModel(cfg, nn.Embedding(V, H), nn.Linear(H, V, bias=False), fused_elementwise)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.to(device=device, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    model.head.embed_tokens.to(device)
    g = torch.Generator().manual_seed(seed)
    n = 40
    doc = torch.tensor([0] * 17 + [1] * (n - 17), dtype=torch.int32)
    pos = torch.cat([torch.arange(17), torch.arange(n - 17)])
    a = torch.tensor(anchors)
    block = torch.full((len(anchors), BS), V - 1)
    block[:, 0] = torch.randint(0, V - 1, (len(anchors),), generator=g)
    layout = build_layout(doc.to(device), pos.to(device), doc[a].to(device), a.to(device), pos[a].to(device), BS)
    return model, torch.randn(n, K * H, generator=g).to(device), block.to(device), layout


def _drafter_step(model, ctx, block, layout, mode: str):
    """Output and parameter gradients of one forward + backward (bf16 autocast in mode "autocast")."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=mode == "autocast"):
        out = model(ctx, block, layout)
    out.float().square().mean().backward()
    return [out.detach()] + [p.grad for p in model.parameters()]


def _check_drafter(monkeypatch, mode: str, device: str):
    """The drafter's fused path (forced on for CPU tensors) against its eager path; a second batch
    with other anchors (other row counts) runs without recompiling."""
    for i, anchors in enumerate(([3, 12, 25, 30], [2, 5, 9, 20, 22, 33, 36])):
        model, ctx, block, layout = _drafter_case(i, anchors, mode, device)
        monkeypatch.setattr(fused, "active", lambda x: False)
        ref = _drafter_step(model, ctx, block, layout, mode)
        monkeypatch.setattr(fused, "active", lambda x: True)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _drafter_step(model, ctx, block, layout, mode)
        for r, c in zip(ref, got, strict=True):
            assert c.dtype == r.dtype
            torch.testing.assert_close(c, r, **DRAFTER_TOL[mode])


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_drafter_fused_path_matches_eager(monkeypatch, mode):
    """float32 parameters, bf16 parameters (the benchmark), float32 parameters under bf16 autocast
    (the trainer's CUDA setup)."""
    _check_drafter(monkeypatch, mode, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_cuda_drafter_fused_path_matches_eager(monkeypatch, mode):
    _check_drafter(monkeypatch, mode, "cuda")


def test_a_drafter_built_without_fused_elementwise_never_calls_the_compiled_kernels(monkeypatch):
    """`fused_elementwise=False` (--no-fused-elementwise) keeps every block on its eager modules even for tensors
    the kernels would serve; the same drafter built with it on calls them."""
    calls = []
    monkeypatch.setattr(fused, "active", lambda x: True)
    monkeypatch.setattr(fused, "compiled", lambda name: calls.append(name) or fused._MATH[name])
    for on in (False, True):
        model, ctx, block, layout = _drafter_case(0, [3, 12, 25, 30], "fp32", "cpu", fused_elementwise=on)
        _drafter_step(model, ctx, block, layout, "fp32")
        assert bool(calls) == on, calls
    assert set(calls) == set(fused._MATH)
