"""The transformers Qwen3 blocks the drafter is made of (RMSNorm, MLP, rotary embedding), written out
so a drafter rank never imports transformers' modelling code (a third of its imports); each is
transformers' own op for op, with the same parameter and buffer names (tests/dflash/test_blocks.py).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from dflash.fused import rms_norm_math


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: float32 variance and rsqrt, downcast, then the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_math(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def activation(name: str) -> nn.Module:
    """transformers' ACT2FN[name]; SiLU (every Qwen3) without importing transformers.activations."""
    if name == "silu":
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class MLP(nn.Module):
    """Qwen3MLP: down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """Qwen3RotaryEmbedding: (cos, sin) of positions, from the config's rope_parameters (dynamic types
    update through transformers' own decorator)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn = (self.compute_default_rope_parameters if self.rope_type == "default"
                        else ROPE_INIT_FUNCTIONS[self.rope_type])
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs) -> tuple[torch.Tensor, float]:
        """The original RoPE's inverse frequencies (and an attention factor of 1)."""
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
