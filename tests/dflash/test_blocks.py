"""dflash.blocks against the transformers modules it replaces (Qwen3RMSNorm, Qwen3MLP,
Qwen3RotaryEmbedding): the same parameter and buffer names, bit-identical outputs and gradients,
every rope type; and a drafter rank's imports no longer include transformers' modelling code."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash.blocks import MLP, RMSNorm, RotaryEmbedding


def _config(**kw) -> Qwen3Config:
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    base.update(kw)
    return Qwen3Config(**base)


def _same_forward_backward(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor) -> None:
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    assert torch.equal(ya, yb)
    grad = torch.randn_like(ya)
    ya.backward(grad)
    yb.backward(grad)
    assert torch.equal(xa.grad, xb.grad)
    for (name, pa), (_, pb) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_qwen3s(dtype):
    torch.manual_seed(0)
    theirs = Qwen3RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
    ours = RMSNorm(64, eps=1e-5).to(dtype)
    _same_forward_backward(ours, theirs, torch.randn(7, 64, dtype=dtype))
    assert repr(ours).endswith(repr(theirs).split("(", 1)[1])


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_mlp_is_qwen3s(act):
    torch.manual_seed(1)
    cfg = _config(hidden_act=act)
    _same_forward_backward(MLP(cfg), Qwen3MLP(cfg), torch.randn(5, 64))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_rotary_embedding_is_qwen3s_for_every_rope_type(rope):
    cfg = _config(rope_parameters=dict(rope), max_position_embeddings=64)
    ours, theirs = RotaryEmbedding(cfg), Qwen3RotaryEmbedding(cfg)
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert ours.state_dict().keys() == theirs.state_dict().keys()   # non-persistent: nothing saved
    assert ours.attention_scaling == theirs.attention_scaling
    x = torch.randn(1, 3, 16, dtype=torch.bfloat16)
    for positions in (torch.arange(40)[None], torch.arange(200)[None], torch.arange(50)[None]):  # dynamic grows
        cos_a, sin_a = ours(x, positions)
        cos_b, sin_b = theirs(x, positions)
        assert torch.equal(cos_a, cos_b) and torch.equal(sin_a, sin_b)
        assert torch.equal(ours.inv_freq, theirs.inv_freq)


def test_a_drafter_rank_does_not_import_transformers_modelling():
    code = ("import sys, dflash.worker\n"
            "from dflash.model import DFlashConfig, DFlashDraftModel\n"
            "heavy = [m for m in ('transformers.modeling_utils', 'transformers.models.qwen3.modeling_qwen3', "
            "'transformers.activations') if m in sys.modules]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
