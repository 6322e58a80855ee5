"""The DFlash drafter, parameter-compatible with z-lab's reference `DFlashDraftModel` (same state-dict
names). As in the reference, the K target layers' features go through fc + hidden_norm once and are
projected by every layer's own k/v; queries come from the block only; RoPE uses absolute positions;
the target's embedding and LM head are frozen and not part of the drafter. Unlike the reference,
forward() runs every draft block of a packed batch at once, masked (dflash.attention) so that each
block sees exactly what one reference inference step would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from transformers import Qwen3Config

from dflash import fused
from dflash.attention import BlockLayout, MaskSet, resolve_backend
from dflash.blocks import MLP, RMSNorm, RotaryEmbedding


_QWEN3_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                 "attention_bias", "attention_dropout", "initializer_range")
"""DFlashConfig fields that are Qwen3Config's own, under the same names."""


@dataclass
class DFlashConfig:
    """Drafter hyper-parameters; names as in the reference checkpoint's config.json."""

    hidden_size: int
    """Model width; equals the target's hidden size (context features and embeddings)."""
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """Target vocabulary size (frozen LM head rows)."""
    target_layer_ids: list[int]
    """Target decoder layers whose outputs form the context (0-based; HF hidden_states[i+1])."""
    mask_token_id: int
    """Token id filling positions 1..B-1 of a draft block."""
    num_target_layers: int
    """Number of decoder layers in the target (reference semantics, not K)."""
    block_size: int = 16
    """Tokens per draft block B (the anchor token plus B-1 predictions)."""
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    """RoPE settings as transformers 5 spells them (copied from the target)."""
    max_position_embeddings: int = 40960
    """Largest position the RoPE tables are meant for."""
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    """Attention dropout (kept for config compatibility; training uses 0)."""
    layer_types: list[str] | None = None
    """Per layer "full_attention" or "sliding_attention"; None means all full."""
    sliding_window: int | None = None
    """Window of sliding_attention layers, in positions."""
    initializer_range: float = 0.02
    """Std of the normal init of linear weights."""
    attn_backend: str = "auto"
    """"auto" (flex on CUDA, dense on CPU), "flex" or "dense". Runtime choice, not saved."""

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for "
                             f"num_hidden_layers={self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise ValueError(f"layer_types: unknown layer type {bad[0]!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_window: required when layer_types has sliding_attention")
        if self.block_size < 2:
            raise ValueError(f"block_size: must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: must name at least one target layer")
        resolve_backend(self.attn_backend, torch.device("cpu"))

    def window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def hf_config(self) -> Qwen3Config:
        """The Qwen3Config the building blocks (dflash.blocks: RMSNorm, MLP, RoPE) are made from."""
        sliding = "sliding_attention" in self.layer_types
        return Qwen3Config(
            **{name: getattr(self, name) for name in _QWEN3_FIELDS}, rope_parameters=dict(self.rope_parameters),
            use_sliding_window=sliding, sliding_window=self.sliding_window if sliding else None,
            max_window_layers=self.num_hidden_layers, layer_types=list(self.layer_types), tie_word_embeddings=False)

    def to_json_dict(self) -> dict:
        """config.json content the reference DFlashDraftModel (a Qwen3Config) loads."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                  "block_size": self.block_size}
        # is_causal: the reference treats sliding layers as causal unless told; draft blocks are bidirectional.
        return {**self.hf_config().to_dict(), "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                "block_size": self.block_size, "num_target_layers": self.num_target_layers, "is_causal": False,
                "dflash_config": dflash, "use_cache": False}

    @classmethod
    def from_json_dict(cls, d: dict, attn_backend: str = "auto") -> "DFlashConfig":
        dc = d.get("dflash_config", {})
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.update({k: dc[k] for k in ("mask_token_id", "target_layer_ids", "block_size") if k in dc})
        if "rope_parameters" not in d and "rope_theta" in d:
            kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": d["rope_theta"]}
        missing = [k for k in ("mask_token_id", "target_layer_ids", "num_target_layers") if k not in kwargs]
        if missing:
            raise ValueError(f"config.json: missing {missing[0]!r}")
        return cls(**{**kwargs, "attn_backend": attn_backend})


def draft_config_for_target(target_config, num_layers: int, block_size: int, layer_ids: list[int],
                            mask_token_id: int, sliding_window: int | None = None,
                            attn_backend: str = "auto") -> DFlashConfig:
    """A drafter as wide as the target (its embeddings and LM head are shared)."""
    t = target_config
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(t, "rope_theta", 1e6)}
    same = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "rms_norm_eps", "max_position_embeddings", "hidden_act")
    return DFlashConfig(
        **{name: getattr(t, name) for name in same}, num_hidden_layers=num_layers,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        target_layer_ids=list(layer_ids), mask_token_id=mask_token_id, num_target_layers=t.num_hidden_layers,
        block_size=block_size, rope_parameters=dict(rope), attention_bias=bool(getattr(t, "attention_bias", False)),
        layer_types=(["sliding_attention"] * num_layers) if sliding_window else None,
        sliding_window=sliding_window, attn_backend=attn_backend)


def _norm(norm: RMSNorm, x: torch.Tensor, fused_on: bool) -> torch.Tensor:
    """norm(x); one compiled kernel when `fused_on` (the model's fused_elementwise) and fused serves x."""
    return fused.rms_norm(x, norm) if fused_on and fused.active(x) else norm(x)


def _add_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, fused_on: bool):
    """(s, norm(s)) for the residual stream s = x + delta (x when delta is None), one kernel when fused."""
    if delta is None:
        return x, _norm(norm, x, fused_on)
    if fused_on and fused.active(x):
        return fused.add_rms_norm(x, delta, norm)
    x = x + delta
    return x, norm(x)


def _mlp(mlp: MLP, x: torch.Tensor, fused_on: bool) -> torch.Tensor:
    if fused_on and fused.active(x) and mlp.config.hidden_act == "silu":
        return mlp.down_proj(fused.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    return mlp(x)


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int, fused_elementwise: bool = True):
        super().__init__()
        self.fused_elementwise = fused_elementwise
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scaling = c.head_dim ** -0.5
        self.sliding_window = c.window(layer_idx)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, masks: MaskSet):
        """x: [Q, H] block states; ctx: [Np, H] normed context; cos/sin: [Np+Q, D]."""
        nq, nk = x.shape[0], ctx.shape[0] + x.shape[0]
        q = self.q_proj(x).view(nq, self.num_heads, self.head_dim)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=0).view(nk, self.num_kv_heads, self.head_dim)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=0).view(nk, self.num_kv_heads, self.head_dim)
        if self.fused_elementwise and fused.active(x):
            # norms + RoPE + the cast attend() would make (to v's dtype) in one compiled function.
            q, k = fused.qk_norm_rope(q, k, self.q_norm, self.k_norm, cos, sin, v.dtype)
        else:
            k = fused.rope_math(self.k_norm(k), cos, sin)
            q = fused.rope_math(self.q_norm(q), cos[-nq:], sin[-nq:])
        out = masks.attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           self.scaling, self.sliding_window)
        return self.o_proj(out[0].transpose(0, 1).reshape(nq, self.num_heads * self.head_dim))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, hf_config: Qwen3Config, layer_idx: int, fused_elementwise: bool = True):
        super().__init__()
        self.fused_elementwise = fused_elementwise
        self.self_attn = DraftAttention(config, layer_idx, fused_elementwise)
        self.mlp = MLP(hf_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, delta, ctx, cos, sin, masks):
        """(x, delta) -> (x, delta): the residual stream and the previous MLP output not yet added to
        it (None at first), so the add fuses with the next norm."""
        on = self.fused_elementwise
        x, h = _add_norm(x, delta, self.input_layernorm, on)
        x, h = _add_norm(x, self.self_attn(h, ctx, cos, sin, masks), self.post_attention_layernorm, on)
        return x, _mlp(self.mlp, h, on)


class DFlashDraftModel(nn.Module):
    """The drafter. `fused_elementwise`: on CUDA, its RMSNorms, add+RMSNorms, q/k norm+RoPE and SiLU*up run as
    dflash.fused's compiled kernels (the trainer's `model.fused_elementwise`); False: the eager modules."""

    def __init__(self, config: DFlashConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 fused_elementwise: bool = True):
        super().__init__()
        self.fused_elementwise = fused_elementwise
        c = config
        if embed_tokens.weight.shape[1] != c.hidden_size or lm_head.weight.shape[1] != c.hidden_size:
            raise ValueError(f"embed_tokens/lm_head: width {embed_tokens.weight.shape[1]} != "
                             f"hidden_size {c.hidden_size}")
        self.config = config
        hf = c.hf_config()
        self.layers = nn.ModuleList([DraftDecoderLayer(c, hf, i, fused_elementwise)
                                     for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # Outside the module tree (its buffers are non-persistent anyway) so model.to(bf16) leaves
        # inv_freq in float32, as the reference's HF loading does; moved to the device on use.
        self._rotary = [RotaryEmbedding(hf)]
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        # The target's embedding and LM head, outside the module tree: not trained, saved or moved.
        self.head = SimpleNamespace(embed_tokens=embed_tokens.requires_grad_(False),
                                    lm_head=lm_head.requires_grad_(False))
        self.reset_parameters()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, self.config.initializer_range)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The frozen LM head's logits of [R, H] block states (dflash.lm_loss forms the same, chunked)."""
        return self.head.lm_head(hidden.to(self.head.lm_head.weight.dtype))

    def forward(self, context: torch.Tensor, block_ids: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """context [N, K*H], block_ids [M, B], layout (build_layout) -> final-normed block states
        [Mp*B, H], padded; block j's rows are j*B .. j*B+B-1."""
        dtype = self.fc.weight.dtype
        bs, np_, mp = layout.block_size, layout.num_ctx_padded, layout.anchor_doc.shape[0]
        if block_ids.shape != (layout.num_anchors, bs) or context.shape[0] != layout.num_ctx:
            raise ValueError(f"DFlashDraftModel.forward: context {tuple(context.shape)} / block_ids "
                             f"{tuple(block_ids.shape)} do not match the layout")
        if not torch.is_autocast_enabled(context.device.type):
            context = context.to(dtype)  # under autocast fc casts itself; no float32 copy of [N, K*H]
        ctx = _norm(self.hidden_norm, self.fc(context), self.fused_elementwise)
        ctx = torch.cat([ctx, ctx.new_zeros(np_ - ctx.shape[0], ctx.shape[1])])
        ids = block_ids.new_full((mp, bs), self.config.mask_token_id)
        ids[: block_ids.shape[0]] = block_ids
        x = self.head.embed_tokens(ids.reshape(-1)).to(dtype)
        rotary = self._rotary[0]
        if rotary.inv_freq.device != x.device:
            rotary.to(x.device)
        cos, sin = rotary(x, layout.kv_pos[None])
        backend = resolve_backend(self.config.attn_backend, x.device)
        masks = MaskSet(layout, backend, {self.config.window(i) for i in range(len(self.layers))})
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, ctx, cos[0], sin[0], masks)
        # An eager add: a fused add+norm's unread sum would get a materialised zero gradient.
        return _norm(self.norm, x if delta is None else x + delta, self.fused_elementwise)
