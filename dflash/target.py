"""The frozen target: capture K decoder-layer outputs (HF's hidden_states[i + 1], the features the
reference drafter reads) and stop the forward after the deepest one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """round(linspace(1, num_layers - 3, k)), exactly as the reference's build_target_layer_ids."""
    if k < 1 or num_layers < 1:
        raise ValueError(f"default_layer_ids: need k >= 1 and num_layers >= 1, got k={k}, num_layers={num_layers}")
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


class _StopForward(Exception):
    """Raised from the deepest captured layer's hook: nothing after it runs."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a causal LM (model.model.layers) or a base model (model.layers)."""
    for path in ("model.layers", "layers", "model.language_model.layers", "language_model.model.layers"):
        obj = functools.reduce(lambda o, name: getattr(o, name, None), path.split("."), model)
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"target model {type(model).__name__}: no decoder layer list found")


class TargetCapture:
    """Frozen, eval-mode target whose forward returns K layer outputs [B, T, H] and stops early."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        if not layer_ids or any(i < 0 or i >= len(layers) for i in layer_ids):
            raise ValueError(f"layer_ids: {layer_ids} out of range for a target with {len(layers)} layers")
        if list(layer_ids) != sorted(set(layer_ids)):
            raise ValueError(f"layer_ids: must be strictly increasing, got {layer_ids}")
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.config = model.config
        self.layer_ids = list(layer_ids)
        self.hidden_size = int(self.config.hidden_size)
        # Run the base model (no LM head) when the model has one.
        self._body = getattr(model, "model", model)
        self._captured: dict[int, torch.Tensor] = {}
        # Hooks act only inside __call__, so the same model still runs plain forwards (decoding).
        self._active = False
        last = self.layer_ids[-1]
        self._handles = [layers[i].register_forward_hook(self._make_hook(i, stop=i == last))
                         for i in self.layer_ids]

    def close(self) -> None:
        """Remove the hooks (the model stays usable; capturing from it again needs a new object)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, idx: int, stop: bool):
        def hook(module, args, output):
            if not self._active:
                return None
            self._captured[idx] = output[0] if isinstance(output, tuple) else output   # 4.x: a tuple
            if stop:
                raise _StopForward()
        return hook

    @classmethod
    def from_pretrained(cls, model_dir, num_layers: int = 5, device="cpu", dtype=None) -> "TargetCapture":
        from transformers import AutoModelForCausalLM

        device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
        return cls(model, default_layer_ids(model.config.num_hidden_layers, num_layers))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        device = self.device
        self._captured.clear()
        self._active = True
        with torch.no_grad():
            try:
                self._body(input_ids=input_ids.to(device, non_blocking=True),
                           attention_mask=attention_mask.to(device, non_blocking=True), use_cache=False)
            except _StopForward:
                pass
            else:
                raise RuntimeError("TargetCapture: the deepest hooked layer never ran")
            finally:
                self._active = False
        return [self._captured.pop(i) for i in self.layer_ids]


@dataclass
class TargetHead:
    """The target's frozen input embedding and LM head, for drafter ranks that never load the target."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    config: object


def _find_key(keys, suffix: str) -> str | None:
    hits = sorted(k for k in keys if k == suffix or k.endswith("." + suffix))
    # Prefer the shortest match (model.embed_tokens.weight over e.g. a vision tower's).
    return min(hits, key=len) if hits else None


def load_target_head(model_dir, device, dtype) -> TargetHead:
    """Read only embed_tokens (and lm_head, unless tied) from the target's safetensors."""
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir))
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    elif (model_dir / "model.safetensors").exists():
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    embed_key = _find_key(weight_map, "embed_tokens.weight")
    if embed_key is None:
        raise ValueError(f"{model_dir}: no embed_tokens.weight in the safetensors")
    head_key = _find_key(weight_map, "lm_head.weight")
    tied = bool(getattr(config, "tie_word_embeddings", False)) or head_key is None

    def read(key):
        with safe_open(str(model_dir / weight_map[key]), "pt", device="cpu") as f:
            return f.get_tensor(key).to(device=device, dtype=dtype)

    embed = nn.Embedding.from_pretrained(read(embed_key), freeze=True)   # the tensor itself, not a copy
    head_w = embed.weight.data if tied else read(head_key)
    lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(head_w, requires_grad=False)
    return TargetHead(embed, lm_head, config)


def target_head_from_model(model: nn.Module) -> TargetHead:
    """The same frozen pair taken from a loaded HF causal LM (tests, single-process runs)."""
    embed = model.get_input_embeddings()
    head = getattr(model, "lm_head", None) or model.get_output_embeddings()
    return TargetHead(embed, head, model.config)
