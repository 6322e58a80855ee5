"""dflash.tiny: the built-in tiny Qwen3 target, its tokenizer, and the self-generated corpus."""

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import torch

from dflash.data import load_conversations
from dflash.tiny import (IM_END, MAX_NEW_TOKENS, MIN_NEW_TOKENS, MARKER_NAME, build_builtin_corpus,
                         build_tiny_target, ensure_builtin, make_tiny_model)



@dataclass
class CorpusStats:
    """How interesting the target's continuations are (a degenerate target makes a useless corpus)."""
    num_conversations: int
    """Conversations in the corpus."""
    distinct_continuations: int
    """Distinct assistant turns."""
    mean_new_tokens: float
    """Mean assistant-turn length in tokens."""
    repeat_fraction: float
    """Fraction of assistant tokens equal to the token before them."""
    bigram_determinism: float
    """Fraction of assistant tokens predicted by the most frequent successor of the previous token:
    1.0 means the target is a bigram table and context does not matter."""
    ended_fraction: float
    """Fraction of assistant turns the target ended itself with <|im_end|> before its budget."""


def corpus_stats(path, tokenizer) -> CorpusStats:
    """Statistics of a built-in corpus's assistant turns (tokenised with `tokenizer`)."""
    turns = []
    with open(path) as f:
        for line in f:
            if line.strip():
                messages = json.loads(line)["messages"]
                turns.append(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
    successors: dict[int, Counter] = defaultdict(Counter)
    repeats = pairs = 0
    for ids in turns:
        for prev, nxt in zip(ids, ids[1:]):
            successors[prev][nxt] += 1
            repeats += prev == nxt
            pairs += 1
    top = sum(c.most_common(1)[0][1] for c in successors.values())
    return CorpusStats(
        num_conversations=len(turns),
        distinct_continuations=len({tuple(t) for t in turns}),
        mean_new_tokens=sum(map(len, turns)) / max(len(turns), 1),
        repeat_fraction=repeats / max(pairs, 1),
        bigram_determinism=top / max(pairs, 1),
        ended_fraction=sum(len(t) < MIN_NEW_TOKENS for t in turns) / max(len(turns), 1),
    )


def test_tokenizer_has_specials_chat_template_and_round_trips(tiny_tokenizer):
    tok = tiny_tokenizer
    assert 100 <= len(tok) <= 500
    for name in ("pad_token", "eos_token", "mask_token", "unk_token"):
        assert getattr(tok, name) is not None
    assert len({tok.pad_token_id, tok.eos_token_id, tok.mask_token_id, tok.convert_tokens_to_ids(IM_END),
                tok.convert_tokens_to_ids("<|im_start|>")}) == 5
    text = tok.apply_chat_template([{"role": "user", "content": "count from 3 to 5"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\ncount from 3 to 5<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "user", "count", "from", "3", "to", "5",
                                              "<|im_end|>", "<|im_start|>", "assistant"]
    words = tok("red fox jumps over 42 lazy dog", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in words
    assert tok(tok.decode(words), add_special_tokens=False)["input_ids"] == words


def test_target_builds_fast_reloads_and_gives_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    out = build_tiny_target(tmp_path / "t", seed=3)
    assert time.perf_counter() - start < 20   # "a few seconds"; generous for a loaded CI box
    assert (out / "model.safetensors").is_file() and (out / MARKER_NAME).is_file()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (8, 128, 4, 2, 32)
    assert 256 <= cfg.intermediate_size <= 384
    assert cfg.vocab_size % 8 == 0 and len(tok) <= cfg.vocab_size < len(tok) + 8
    # Default K=5 capture layers round(linspace(1, n_layers - 3, 5)) are 1..5 for 8 layers.
    assert torch.linspace(1, cfg.num_hidden_layers - 3, 5).round().int().tolist() == [1, 2, 3, 4, 5]
    fresh, _ = make_tiny_model(seed=3)
    ids = torch.tensor([tok("count from 3 to 9 then repeat red fox", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh.eval()(ids).logits)
        other, _ = make_tiny_model(seed=4)
        assert not torch.equal(other.eval()(ids).logits, fresh(ids).logits)


def test_build_is_idempotent_and_rebuilds_when_marker_or_seed_changes(tmp_path):
    out = build_tiny_target(tmp_path / "t", seed=0)
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_target(out, seed=0) == out and weights.stat().st_mtime_ns == stamp
    before = weights.read_bytes()
    (out / MARKER_NAME).unlink()
    build_tiny_target(out, seed=0)
    assert (out / MARKER_NAME).is_file() and weights.read_bytes() == before   # rebuilt, same seed
    build_tiny_target(out, seed=1)
    assert weights.read_bytes() != before
    assert not list(tmp_path.glob(".t.tmp-*"))
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a tiny-target build"):
        build_tiny_target(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def assistant_turns(path):
    return [json.loads(line)["messages"] for line in open(path)]


def test_corpus_is_deterministic_for_a_seed(tiny_target_dir, tiny_corpus, tmp_path):
    again = build_builtin_corpus(tiny_target_dir, tmp_path / "again.jsonl", num_conversations=48, seed=0)
    assert again.read_bytes() == tiny_corpus.read_bytes()
    other = build_builtin_corpus(tiny_target_dir, tmp_path / "other.jsonl", num_conversations=48, seed=1)
    assert other.read_bytes() != tiny_corpus.read_bytes()


def test_assistant_turns_are_the_targets_greedy_continuations(tiny_target_dir, tiny_tokenizer, tiny_corpus):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    stops = {tok.convert_tokens_to_ids(IM_END), tok.eos_token_id}
    conversations = assistant_turns(tiny_corpus)
    assert len(conversations) == 48
    for messages in conversations[:6]:
        assert messages[-1]["role"] == "assistant"
        prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        want = tok(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        assert 1 <= len(want) <= MAX_NEW_TOKENS
        with torch.no_grad():   # the prompt alone, unbatched, unpadded
            out = model.generate(input_ids=ids, max_new_tokens=len(want) + 1, do_sample=False)
        got = out[0, ids.shape[1]:].tolist()
        assert got[:len(want)] == want
        if len(want) < MIN_NEW_TOKENS:   # shorter than any budget: the target ended the turn itself
            assert got[len(want)] in stops


def test_corpus_loads_with_masks_on_exactly_the_generated_tokens(tiny_tokenizer, tiny_corpus):
    samples, bad = load_conversations(tiny_corpus, tiny_tokenizer, max_length=512, on_bad_record="fail")
    assert bad.count == 0 and len(samples) == 48
    im_end = tiny_tokenizer.convert_tokens_to_ids(IM_END)
    for sample, messages in zip(samples, assistant_turns(tiny_corpus)):
        want = tiny_tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        assert [i for i, m in zip(sample.input_ids, sample.loss_mask) if m] == want + [im_end]


def test_target_continuations_are_not_degenerate(tiny_tokenizer, tiny_corpus):
    stats = corpus_stats(tiny_corpus, tiny_tokenizer)
    assert stats.num_conversations == 48
    # Learnable (mostly a function of the previous token) but not a lookup table or a single loop:
    # continuations differ between prompts and the context changes the next token some of the time.
    assert stats.distinct_continuations >= 24
    assert stats.repeat_fraction < 0.6             # not one token over and over
    assert 0.5 < stats.bigram_determinism < 0.97
    assert stats.mean_new_tokens > 20


def test_ensure_builtin_holds_out_eval_prompts_and_is_idempotent(tmp_path):
    data = ensure_builtin(tmp_path / "b", seed=0, num_train=24, num_eval=8)
    train, heldout = assistant_turns(data.train_path), assistant_turns(data.eval_path)
    assert len(train) == 24 and len(heldout) == 8
    assert not {json.dumps(m[:-1]) for m in heldout} & {json.dumps(m[:-1]) for m in train}
    stamps = [p.stat().st_mtime_ns for p in (data.train_path, data.eval_path)]
    again = ensure_builtin(tmp_path / "b", seed=0, num_train=24, num_eval=8)
    assert again == data and [p.stat().st_mtime_ns for p in (data.train_path, data.eval_path)] == stamps
