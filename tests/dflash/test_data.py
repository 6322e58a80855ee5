"""dflash.data: JSONL conversations -> samples with an assistant loss mask -> token-budget batches."""

import json
import re

import pytest
import torch

import dflash.data as data_mod
from dflash.data import ChatTokenizer, Sample, TokenBatcher, collate, first_usable_record, load_conversations

# The no-tools part of Qwen2.5-Instruct's chat template: a default system prompt when none is
# given, ChatML turns, and a "\n" after every <|im_end|> (which must stay out of the loss mask).
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per ASCII character) + Qwen specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------- formats and mask
def test_openai_and_sharegpt_give_identical_samples(data_dir, tiny_tokenizer):
    a, bad_a = load_conversations(data_dir / "openai.jsonl", tiny_tokenizer, max_length=256)
    b, bad_b = load_conversations(data_dir / "sharegpt.jsonl", tiny_tokenizer, max_length=256)
    assert bad_a.count == bad_b.count == 0
    assert len(a) == len(b) == 3
    assert [s.input_ids for s in a] == [s.input_ids for s in b]
    assert [s.loss_mask for s in a] == [s.loss_mask for s in b]
    assert a[2].source == f"{data_dir / 'openai.jsonl'}:4"   # blank line 3 is skipped, not a record


def test_loss_mask_is_exactly_assistant_content_and_end_of_turn_tiny(data_dir, tiny_tokenizer):
    samples, _ = load_conversations(data_dir / "openai.jsonl", tiny_tokenizer, max_length=256)
    tokens = tiny_tokenizer.convert_ids_to_tokens(samples[1].input_ids)
    masked = [t for t, m in zip(tokens, samples[1].loss_mask) if m]
    assert masked == ["c", "a", "t", "<|im_end|>", "d", "o", "g", "<|im_end|>"]
    # The role header before each assistant turn is not masked.
    for i, tok in enumerate(tokens):
        if tok == "assistant":
            assert tokens[i - 1] == "<|im_start|>" and samples[1].loss_mask[i - 1:i + 1] == [0, 0]
    assert len(samples[1].input_ids) == len(samples[1].loss_mask)


def expected_qwen_mask(text: str) -> list[int]:
    """Independent reference: split the rendered text into units (a special token, else one char),
    and mark the units of each assistant turn's content and its closing <|im_end|>."""
    spans = [(m.start(1), m.end(2)) for m in re.finditer(
        r"<\|im_start\|>assistant\n(.*?)(<\|im_end\|>)", text, flags=re.S)]
    mask, pos = [], 0
    while pos < len(text):
        special = next((s for s in QWEN_SPECIALS if text.startswith(s, pos)), None)
        mask.append(int(any(a <= pos < b for a, b in spans)))
        pos += len(special) if special else 1
    return mask


def test_loss_mask_on_qwen_template_with_byte_level_tokens(tmp_path):
    tok = byte_level_tokenizer()
    conversation = [{"role": "user", "content": "Hi there"},
                    {"role": "assistant", "content": "Hello!\nHow can I help?"},
                    {"role": "user", "content": "Count to 3"},
                    {"role": "assistant", "content": "1, 2, 3"}]
    path = write_jsonl(tmp_path / "q.jsonl", [{"messages": conversation}])
    (sample,), bad = load_conversations(path, tok, max_length=4096)
    assert bad.count == 0
    text = tok.apply_chat_template(conversation, tokenize=False)
    assert "You are Qwen" in text   # the template injected its default system turn
    want = expected_qwen_mask(text)
    assert len(want) == len(sample.input_ids)   # the reference's units are the tokens
    assert sample.loss_mask == want
    masked = tok.decode([i for i, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert masked == "Hello!\nHow can I help?<|im_end|>1, 2, 3<|im_end|>"


def test_truncation_cuts_ids_and_mask_and_rejects_turns_cut_away(data_dir, tiny_tokenizer, tmp_path):
    path = data_dir / "openai.jsonl"
    full, _ = load_conversations(path, tiny_tokenizer, max_length=256)
    cut, bad = load_conversations(path, tiny_tokenizer, max_length=13)
    assert [len(s.input_ids) for s in full] == [16, 32, 13]
    # Record 2's assistant turns start after token 13: rejected, the others are cut / kept whole.
    assert [s.source for s in cut] == [f"{path}:1", f"{path}:4"]
    assert bad.examples == [f"{path}:2: no assistant token within max_length=13"]
    assert cut[0].input_ids == full[0].input_ids[:13] and cut[0].loss_mask == full[0].loss_mask[:13]
    assert tiny_tokenizer.convert_ids_to_tokens(
        [i for i, m in zip(cut[0].input_ids, cut[0].loss_mask) if m]) == ["3", "4", "5"]
    assert cut[1].input_ids == full[2].input_ids and cut[1].loss_mask == full[2].loss_mask
    # An assistant turn that starts after max_length leaves nothing to learn: a bad record.
    long_prompt = " ".join(["hello"] * 20)
    path = write_jsonl(tmp_path / "long.jsonl", [
        {"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "world"}]},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}])
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=12)
    assert len(samples) == 1 and bad.examples == [f"{path}:1: no assistant token within max_length=12"]


# ----------------------------------------------------------------------------- bad records
BAD_LINES = {
    2: "not valid JSON (",
    3: "record is a JSON list, not an object",
    4: "no 'messages' or 'conversations' list",
    5: "'messages' is not a non-empty list",
    6: "messages[0] is not an object",
    7: "messages[0] has unknown role 'robot'",
    8: "messages[0] has no 'content'",
    9: "messages[0] 'content' is a int, not a string",
    10: "messages[1] has empty content",
    11: "no assistant turn",
    12: "conversations[1] has unknown role 'bot'",
    13: "conversations[1] has no 'from'",
}


def test_bad_records_skip_reports_each_with_file_and_line(data_dir, tiny_tokenizer):
    path = data_dir / "bad.jsonl"
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=256, on_bad_record="skip")
    assert [s.source for s in samples] == [f"{path}:1", f"{path}:15"]
    assert bad.count == len(BAD_LINES) == len(bad.examples)
    for example, (line, reason) in zip(bad.examples, BAD_LINES.items()):
        assert example.startswith(f"{path}:{line}: {reason}"), example
        assert "\n" not in example


@pytest.mark.parametrize("line", sorted(BAD_LINES))
def test_bad_record_fail_raises_with_that_line(data_dir, tiny_tokenizer, tmp_path, line):
    lines = (data_dir / "bad.jsonl").read_text().splitlines()
    path = tmp_path / "one_bad.jsonl"
    path.write_text("\n".join([lines[0], lines[line - 1], lines[0]]) + "\n")
    with pytest.raises(ValueError) as info:
        load_conversations(path, tiny_tokenizer, max_length=256, on_bad_record="fail")
    assert str(info.value).startswith(f"{path}:2: {BAD_LINES[line]}")
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=256, on_bad_record="skip")
    assert len(samples) == 2 and bad.count == 1


def test_missing_file_and_file_without_usable_records(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="data file not found: .*nope.jsonl"):
        load_conversations(tmp_path / "nope.jsonl", tiny_tokenizer, max_length=64)
    path = write_jsonl(tmp_path / "junk.jsonl", ["{not json", {"messages": []}])
    with pytest.raises(ValueError, match=r"junk.jsonl: no usable records \(2 bad; first: .*junk.jsonl:1: not valid JSON"):
        load_conversations(path, tiny_tokenizer, max_length=64)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank.jsonl: no usable records \(0 bad\)"):
        load_conversations(tmp_path / "blank.jsonl", tiny_tokenizer, max_length=64)


def test_template_failure_is_a_bad_record(tmp_path, tiny_tokenizer):
    strict = "{%- for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}" \
             "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}" \
             "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    path = write_jsonl(tmp_path / "sys.jsonl", [
        {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                      {"role": "assistant", "content": "c"}]},
        {"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}])
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=64, chat_template=strict)
    assert len(samples) == 1
    assert bad.examples[0].startswith(f"{path}:1: chat template failed:") and "no system" in bad.examples[0]


# ----------------------------------------------------------------------------- hostile input
GOOD = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}


def test_non_utf8_bytes_are_a_counted_bad_record_never_replaced(tmp_path, tiny_tokenizer):
    path = tmp_path / "latin1.jsonl"
    bad_line = json.dumps(GOOD).replace("world", "w\u00f6rld").encode("latin-1")
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + bad_line + b"\n" + json.dumps(GOOD).encode() + b"\n")
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=64)
    column = bad_line.index(b"\xf6") + 1
    assert [s.source for s in samples] == [f"{path}:1", f"{path}:3"]
    assert bad.count == 1 and bad.examples == [f"{path}:2: not valid UTF-8 (byte 0xf6 at column {column})"]
    with pytest.raises(ValueError, match=f"^{path}:2: not valid UTF-8"):
        load_conversations(path, tiny_tokenizer, max_length=64, on_bad_record="fail")


def test_a_line_over_the_bound_is_a_bad_record_and_the_next_line_still_reads(tmp_path, tiny_tokenizer,
                                                                              monkeypatch):
    monkeypatch.setattr(data_mod, "MAX_LINE_BYTES", 2048)
    monkeypatch.setattr(data_mod, "_SKIP_CHUNK_BYTES", 100)   # read past it in many chunks
    huge = {"messages": [{"role": "user", "content": "hello " * 1000}, {"role": "assistant", "content": "x"}]}
    exact = json.dumps(GOOD)
    exact = exact[:-1] + " " * (2048 - len(exact)) + "}"   # exactly at the bound: still a record
    path = write_jsonl(tmp_path / "big.jsonl", [huge, GOOD, exact])
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=64)
    assert bad.examples == [f"{path}:1: line longer than 2048 bytes"]
    assert [s.source for s in samples] == [f"{path}:2", f"{path}:3"]


def test_bom_on_the_first_line_is_not_a_bad_record(tmp_path, tiny_tokenizer):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    samples, bad = load_conversations(path, tiny_tokenizer, max_length=64)
    assert len(samples) == 1 and bad.count == 0


class CountingTokenizer:
    """Wraps a tokenizer and records the longest text it was asked to tokenise."""

    def __init__(self, inner):
        self.inner, self.longest_chars = inner, 0

    def __call__(self, text, **kw):
        self.longest_chars = max(self.longest_chars, len(text))
        return self.inner(text, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_huge_record_is_tokenised_only_as_far_as_max_length_can_use(tmp_path):
    tok = CountingTokenizer(byte_level_tokenizer())
    chat = ChatTokenizer(tok)
    long_answer = "abc def " * 250_000   # 2 MB of assistant text
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long_answer}]
    ids, mask = chat.encode(conv, max_length=100)
    bound = 2 * 101 * chat.max_token_chars
    assert tok.longest_chars < bound + 500   # the bound plus the template's own text
    assert len(ids) == len(mask) == 100
    full_ids, full_mask = ChatTokenizer(byte_level_tokenizer()).encode(conv)
    assert (ids, mask) == (full_ids[:100], full_mask[:100])
    many = [t for _ in range(5000) for t in ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})]
    tok.longest_chars = 0
    ids, mask = chat.encode(many, max_length=64)
    assert len(ids) == 64 and tok.longest_chars < 64 * 40   # 64 turns at most, not 10000


@pytest.mark.parametrize("max_length", [5, 13, 16, 31, 64])
def test_bounded_encoding_equals_full_encoding_cut(data_dir, tiny_tokenizer, max_length):
    chat = ChatTokenizer(tiny_tokenizer)
    for line in (data_dir / "openai.jsonl").read_text().splitlines():
        if line.strip():
            turns = data_mod._normalise_turns(json.loads(line))
            full_ids, full_mask = chat.encode(turns)
            assert chat.encode(turns, max_length) == (full_ids[:max_length], full_mask[:max_length])


def test_unknown_long_words_fall_back_to_the_whole_record(tiny_tokenizer):
    """A word-level tokenizer maps an unknown word of any length to one token, beyond the bound."""
    chat = ChatTokenizer(tiny_tokenizer)
    words = " ".join("x" * 500 for _ in range(40))
    conv = [{"role": "user", "content": words}, {"role": "assistant", "content": "cat"}]
    assert len(words) > 2 * 49 * chat.max_token_chars   # the bound cuts this record
    full_ids, full_mask = chat.encode(conv)
    assert chat.encode(conv, max_length=48) == (full_ids[:48], full_mask[:48])
    assert any(chat.encode(conv, max_length=48)[1])


def test_first_usable_record_reads_only_that_far(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ["{oops", GOOD, "{never read"])
    assert first_usable_record(path, tiny_tokenizer, 64).source == f"{path}:2"
    with pytest.raises(ValueError, match=f"^{path}:1: not valid JSON"):
        first_usable_record(path, tiny_tokenizer, 64, on_bad_record="fail")
    only_bad = write_jsonl(tmp_path / "b.jsonl", ["{oops", {"messages": []}])
    with pytest.raises(ValueError, match=r"b.jsonl: no usable records \(2 bad; first: .*b.jsonl:1: not valid JSON"):
        first_usable_record(only_bad, tiny_tokenizer, 64)


# ----------------------------------------------------------------------------- batching
def make_samples(lengths):
    return [Sample(input_ids=[100 + i] * n, loss_mask=[0] + [1] * (n - 1), source=f"s:{i}")
            for i, n in enumerate(lengths)]


LENGTHS = [5, 17, 3, 40, 9, 22, 11, 6, 30, 8, 14, 2, 25, 7, 19, 12, 4, 33, 10, 16]


def take(batcher, n):
    it = iter(batcher)
    return [next(it) for _ in range(n)]


def ids_of(batch):
    """Sample index of each row (rows are filled with 100 + index)."""
    return [int(row[0]) - 100 for row in batch.input_ids]


def test_collate_right_pads():
    batch = collate(make_samples([3, 5]), pad_token_id=7)
    assert batch.input_ids.tolist() == [[100, 100, 100, 7, 7], [101] * 5]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.loss_mask.dtype == torch.int64
    assert batch.num_tokens == 8


def test_batches_respect_the_token_budget_and_pad_right():
    samples = make_samples(LENGTHS)
    batcher = TokenBatcher(samples, tokens_per_batch=48, pad_token_id=0, seed=3)
    plan = batcher.epoch_plan(0)
    assert sorted(i for b in plan for i in b) == list(range(len(samples)))
    for batch in take(batcher, len(plan)):
        rows, width = batch.input_ids.shape
        assert rows * width <= 48 or rows == 1
        for r, i in enumerate(ids_of(batch)):
            n = LENGTHS[i]
            assert batch.attention_mask[r].tolist() == [1] * n + [0] * (width - n)
            assert batch.input_ids[r, n:].eq(0).all() and batch.loss_mask[r, n:].eq(0).all()
            assert batch.loss_mask[r, :n].tolist() == samples[i].loss_mask
        assert batch.num_tokens == int(batch.attention_mask.sum())
    # Greedy: each batch would overflow with the next sample of the order added.
    for b, nxt in zip(plan, plan[1:]):
        assert (len(b) + 1) * max(LENGTHS[i] for i in b + nxt[:1]) > 48


def test_sample_longer_than_budget_goes_alone():
    samples = make_samples([4, 100, 4, 4])
    batcher = TokenBatcher(samples, tokens_per_batch=16, pad_token_id=0, seed=0)
    plan = batcher.epoch_plan(0)
    assert [1] in plan and all(len(b) == 1 for b in plan if 1 in b)
    assert sorted(i for b in plan for i in b) == [0, 1, 2, 3]


def test_deterministic_for_a_seed_and_reshuffled_per_epoch():
    samples = make_samples(LENGTHS)
    a = [ids_of(b) for b in take(TokenBatcher(samples, 48, 0, seed=5), 30)]
    b = [ids_of(b) for b in take(TokenBatcher(samples, 48, 0, seed=5), 30)]
    c = [ids_of(b) for b in take(TokenBatcher(samples, 48, 0, seed=6), 30)]
    assert a == b and a != c
    batcher = TokenBatcher(samples, 48, 0, seed=5)
    assert batcher.epoch_plan(0) != batcher.epoch_plan(1)
    # Iterating runs through epoch 0 then epoch 1: every sample once per epoch.
    n0 = len(batcher.epoch_plan(0))
    flat = [i for ids in a for i in ids]
    assert sorted(flat[:len(samples)]) == list(range(len(samples)))
    assert sorted(flat[len(samples):2 * len(samples)]) == list(range(len(samples)))
    assert [i for p in batcher.epoch_plan(0) for i in p] == flat[:len(samples)] and n0 < 30
    assert [i for p in batcher.epoch_plan(1) for i in p] == flat[len(samples):2 * len(samples)]


@pytest.mark.parametrize("num_shards", [2, 3])
def test_shards_are_disjoint_and_cover_every_epoch(num_shards):
    samples = make_samples(LENGTHS)
    for epoch in (0, 1):
        seen = []
        for shard in range(num_shards):
            batcher = TokenBatcher(samples, 48, 0, seed=1, shard=shard, num_shards=num_shards)
            seen.append({i for b in batcher.epoch_plan(epoch) for i in b})
        assert sum(len(s) for s in seen) == len(samples)
        assert set().union(*seen) == set(range(len(samples)))
    with pytest.raises(ValueError, match="shard must be in"):
        TokenBatcher(samples, 48, 0, seed=1, shard=2, num_shards=2)
    with pytest.raises(ValueError, match="non-empty shards"):
        TokenBatcher(samples[:1], 48, 0, seed=1, num_shards=2)
