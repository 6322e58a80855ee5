"""Greedy decoding and lossless greedy draft-and-verify with a DFlash drafter (batch size 1), as the
reference dflash_generate: the target verifies each drafted block in one forward and keeps the longest
agreeing prefix plus its own next token. No KV cache: exact, and fine for evaluation's small targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.attention import build_layout


@dataclass
class DecodeStats:
    acceptance_length: float
    """Mean tokens produced per verify step (accepted drafts + the target's bonus token)."""
    verify_steps: int
    """Target verify forwards after the prefill."""
    tokens_per_step: list[int]
    """Tokens produced by each verify step."""


def _check_input(input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected shape [1, T>0], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_generate(target_model, input_ids: torch.Tensor, max_new_tokens: int,
                    stop_token_ids=()) -> torch.Tensor:
    """[1, T] -> [1, T + up to max_new_tokens], argmax per token; stops after any of stop_token_ids."""
    _check_input(input_ids, max_new_tokens)
    seq = input_ids.to(_device(target_model))
    stops = set(int(t) for t in stop_token_ids)
    for _ in range(max_new_tokens):
        logits = target_model(seq, use_cache=False).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if stops and int(seq[0, -1]) in stops:  # host read: eval-only decoding branches on it
            break
    return seq


def _features(out, layer_ids: list[int]) -> torch.Tensor:
    """[L, K*H] context features: outputs of the given layers (HF hidden_states[i + 1])."""
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


@torch.no_grad()
def draft_block(drafter, context: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """The B-1 tokens proposed for positions n+1.. from context [n, K*H] and token[n] (0-dim)."""
    n, device, bs = context.shape[0], context.device, drafter.block_size
    layout = build_layout(torch.zeros(n, dtype=torch.int32, device=device),
                          torch.arange(n, device=device),
                          torch.zeros(1, dtype=torch.int32, device=device),
                          torch.tensor([n], device=device), torch.tensor([n], device=device), bs)
    block = torch.full((1, bs), drafter.mask_token_id, dtype=torch.int64, device=device)
    block[0, 0] = last_token
    hidden = drafter(context, block, layout)[1:bs]
    return drafter.logits(hidden).argmax(-1)


@torch.no_grad()
def speculative_generate(target_model, drafter, input_ids: torch.Tensor, max_new_tokens: int,
                         layer_ids: list[int], stop_token_ids=()) -> tuple[torch.Tensor, DecodeStats]:
    _check_input(input_ids, max_new_tokens)
    device = _device(target_model)
    seq = input_ids.to(device)
    num_input = seq.shape[1]
    max_length = num_input + max_new_tokens
    bs = drafter.block_size
    # Prefill: the target's first token, and context features for the prompt.
    out = target_model(seq, use_cache=False, output_hidden_states=True)
    seq = torch.cat([seq, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    context = _features(out, layer_ids)
    produced_per_step: list[int] = []
    stops = set(int(t) for t in stop_token_ids)
    start = num_input  # index of the last known token; context covers positions < start
    if stops and int(seq[0, -1]) in stops:
        start = max_length  # the first token already ended the turn
    while start + 1 < max_length:
        verify_size = min(bs, max_length - start)
        proposal = draft_block(drafter, context.to(drafter.fc.weight.device), seq[0, start])
        block = torch.cat([seq[0, start:start + 1], proposal[: verify_size - 1].to(device)])
        out = target_model(torch.cat([seq[:, :start], block[None]], dim=1), use_cache=False,
                           output_hidden_states=True)
        posterior = out.logits[0, start:start + verify_size].argmax(-1)
        # Host read of the accepted count: decoding branches on it (deliberate sync, eval only).
        accepted = int((block[1:] == posterior[:-1]).to(torch.int64).cumprod(0).sum())
        new = torch.cat([block[1:1 + accepted], posterior[accepted:accepted + 1]])
        produced = min(accepted + 1, max_length - start - 1)
        ended = [i for i, t in enumerate(new[:produced].tolist()) if t in stops]
        if ended:
            produced = ended[0] + 1  # keep the end-of-turn token, drop anything after it
        seq = torch.cat([seq, new[:produced][None]], dim=1)
        start += produced
        context = _features(out, layer_ids)[:start]
        produced_per_step.append(produced)
        if ended:
            break
    steps = len(produced_per_step)
    stats = DecodeStats(sum(produced_per_step) / steps if steps else 0.0, steps, produced_per_step)
    return seq[:, :max_length], stats
