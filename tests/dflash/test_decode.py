"""dflash.decode: draft-and-verify output equals greedy decoding; acceptance accounting."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash.decode as decode
from dflash.model import DFlashDraftModel, draft_config_for_target

CFG = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=64)
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    # float64: argmax ties between differently-shaped forwards cannot flip the comparison
    return Qwen3ForCausalLM(CFG).eval().double()


def _drafter(target, block_size=4):
    torch.manual_seed(1)
    cfg = draft_config_for_target(CFG, 1, block_size, LAYERS, 63)
    return DFlashDraftModel(cfg, target.model.embed_tokens, target.lm_head).double()


@pytest.mark.parametrize("prompt_len,new", [(5, 9), (1, 5)])
def test_speculative_equals_greedy(target, prompt_len, new):
    prompt = torch.randint(0, 64, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    greedy = decode.greedy_generate(target, prompt, new)
    spec, stats = decode.speculative_generate(target, _drafter(target), prompt, new, LAYERS)
    assert greedy.shape == (1, prompt_len + new)
    assert torch.equal(spec, greedy)
    assert sum(stats.tokens_per_step) == new - 1  # the prefill produced the first token
    assert stats.verify_steps == len(stats.tokens_per_step)
    assert stats.acceptance_length == pytest.approx((new - 1) / stats.verify_steps)
    assert all(1 <= t <= 4 for t in stats.tokens_per_step)


def test_oracle_drafter_accepts_whole_blocks(target, monkeypatch):
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(9))
    new = 14
    greedy = decode.greedy_generate(target, prompt, new)

    def oracle(drafter, context, last_token):  # proposes the target's own continuation
        n = context.shape[0]
        return greedy[0, n + 1:n + drafter.block_size]

    monkeypatch.setattr(decode, "draft_block", oracle)
    spec, stats = decode.speculative_generate(target, _drafter(target), prompt, new, LAYERS)
    assert torch.equal(spec, greedy)
    assert stats.tokens_per_step == [4, 4, 4, 1]  # 13 tokens after the prefill, block size 4
    assert stats.acceptance_length == pytest.approx(13 / 4)


def test_stop_tokens_end_both_decoders_at_the_same_token(target, monkeypatch):
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(9))
    full = decode.greedy_generate(target, prompt, 14)
    stop = int(full[0, 4 + 6])  # the 7th generated token ends the turn (or an earlier copy of it)
    greedy = decode.greedy_generate(target, prompt, 14, stop_token_ids=[stop])
    cut = 4 + next(i for i, t in enumerate(full[0, 4:].tolist()) if t == stop) + 1
    assert torch.equal(greedy, full[:, :cut])

    def oracle(drafter, context, last_token):  # proposes the target's own continuation, past the stop
        n = context.shape[0]
        return full[0, n + 1:n + drafter.block_size]

    monkeypatch.setattr(decode, "draft_block", oracle)
    spec, stats = decode.speculative_generate(target, _drafter(target), prompt, 14, LAYERS, [stop])
    assert torch.equal(spec, greedy)
    assert sum(stats.tokens_per_step) == greedy.shape[1] - 5  # tokens after the prefill's, stop included


def test_bad_arguments(target):
    with pytest.raises(ValueError, match="input_ids"):
        decode.greedy_generate(target, torch.zeros(2, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode.speculative_generate(target, _drafter(target), torch.zeros(1, 3, dtype=torch.long), 0, LAYERS)
