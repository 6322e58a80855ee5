"""JSONL conversations -> tokenised samples with an assistant loss mask -> token-budget batches.

Records are `{"messages": [...]}` or `{"conversations": [...]}` of OpenAI-style (role/content) or
ShareGPT-style (from/value) turns. The loss mask is 1 exactly on each assistant turn's content and its
end-of-turn token, found by rendering the chat template prefix by prefix. Work per record is bounded.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

ROLE_ALIASES = {"system": "system", "user": "user", "assistant": "assistant",
                "human": "user", "gpt": "assistant"}
MAX_EXAMPLES = 20
# One JSONL line at most (newline excluded): millions of tokens, so a longer line is a malformed file.
MAX_LINE_BYTES = 16 * 1024 * 1024
_SKIP_CHUNK_BYTES = 1024 * 1024   # how an over-long line is read past


@dataclass
class Sample:
    """One tokenised conversation."""
    input_ids: list[int]
    """Token ids of the whole templated conversation (truncated to max_length)."""
    loss_mask: list[int]
    """1 on assistant content and end-of-turn tokens, 0 elsewhere; same length as input_ids."""
    source: str
    """Where it came from, "FILE:LINE", for messages about it."""


@dataclass
class BadRecords:
    """Records that were rejected while loading, with the first few reasons."""
    count: int = 0
    examples: list[str] = field(default_factory=list)
    """Up to MAX_EXAMPLES one-line reasons, "FILE:LINE: reason"."""

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(message)


class _BadRecord(Exception):
    """A record-level problem; the loader prefixes FILE:LINE."""


def _normalise_turns(record) -> list[dict]:
    """The record's turns as [{"role", "content"}] with OpenAI role names, or _BadRecord."""
    if not isinstance(record, dict):
        raise _BadRecord(f"record is a JSON {type(record).__name__}, not an object")
    key = "messages" if "messages" in record else "conversations" if "conversations" in record else None
    if key is None:
        raise _BadRecord("no 'messages' or 'conversations' list")
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise _BadRecord(f"'{key}' is not a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise _BadRecord(f"{where} is not an object")
        role_key, text_key = ("role", "content") if "role" in turn or "content" in turn else ("from", "value")
        if role_key not in turn:
            raise _BadRecord(f"{where} has no '{role_key}'")
        role = ROLE_ALIASES.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            raise _BadRecord(f"{where} has unknown role {turn[role_key]!r}")
        if text_key not in turn:
            raise _BadRecord(f"{where} has no '{text_key}'")
        text = turn[text_key]
        if not isinstance(text, str):
            raise _BadRecord(f"{where} '{text_key}' is a {type(text).__name__}, not a string")
        if not text.strip():
            raise _BadRecord(f"{where} has empty content")
        out.append({"role": role, "content": text})
    if not any(t["role"] == "assistant" for t in out):
        raise _BadRecord("no assistant turn")
    return out


class ChatTokenizer:
    """Tokenises conversations through a chat template and marks the assistant tokens."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
        self._special_ids = set(getattr(tokenizer, "all_special_ids", [])) | {
            i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special}
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max((len(t) for t in vocab), default=64)
        """The longest token's text: no token covers more characters (unknown words aside)."""

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=generation_prompt)
        # The template already writes any BOS/special tokens as text.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, messages: list[dict], max_length: int | None = None) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of a conversation, cut to max_length; _BadRecord if the template
        misbehaves. Only what can reach max_length tokens is rendered (twice max_token_chars a token)."""
        if max_length is None:
            return self._encode(messages, None)
        budget_chars = 2 * (max_length + 1) * self.max_token_chars
        kept, cut = [], len(messages) > max_length
        for turn in messages[:max_length]:
            if budget_chars <= 0:
                cut = True
                break
            content = turn["content"][:budget_chars]
            cut = cut or len(content) < len(turn["content"])
            budget_chars -= len(content)
            kept.append({**turn, "content": content})
        ids, mask = self._encode(kept, max_length)
        if cut and len(ids) < max_length:   # a token longer than the bound (an unknown word): redo whole
            ids, mask = self._encode(messages, max_length)
        return ids[:max_length], mask[:max_length]

    def _encode(self, messages: list[dict], max_length: int | None) -> tuple[list[int], list[int]]:
        try:
            full = self._ids(messages, generation_prompt=False)
            mask = [0] * len(full)
            for i, turn in enumerate(messages):
                if turn["role"] != "assistant":
                    continue
                # Tokens before the turn's content: the prefix plus the assistant header.
                start = self._ids(messages[:i], generation_prompt=True)
                if max_length is not None and len(start) >= max_length:
                    break   # this turn and every later one start past the cut
                # Tokens through the end of the turn (content, end-of-turn, any separator).
                end = self._ids(messages[:i + 1], generation_prompt=False)
                for what, prefix in (("header", start), ("turn", end)):
                    if full[:len(prefix)] != prefix:
                        raise _BadRecord(f"chat template is not prefix-stable at the {what} of messages[{i}]")
                # Keep the end-of-turn token but not what the template writes after it (Qwen's "\n").
                stop = next((j + 1 for j in range(len(end) - 1, len(start) - 1, -1) if end[j] in self._special_ids),
                            len(end))
                mask[len(start):stop] = [1] * (stop - len(start))
        except _BadRecord:
            raise
        except Exception as exc:   # jinja errors ("roles must alternate ...") are record problems
            raise _BadRecord(f"chat template failed: {type(exc).__name__}: {exc}") from None
        return full, mask


def _read_lines(f) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) for each line of a binary file; None for a line over MAX_LINE_BYTES,
    which is read past in chunks, never held whole."""
    for line_no, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) > MAX_LINE_BYTES and raw[MAX_LINE_BYTES:] != b"\n":
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(_SKIP_CHUNK_BYTES)
            raw = None
        yield line_no, raw


def _parse_line(raw: bytes | None, line_no: int, source: str, chat: ChatTokenizer,
                max_length: int) -> Sample | None:
    """One line -> a Sample, None for a blank line, or _BadRecord."""
    if raw is None:
        raise _BadRecord(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadRecord(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
    if line_no == 1:
        text = text.removeprefix("\ufeff")   # a byte-order mark some editors write
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadRecord(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    input_ids, loss_mask = chat.encode(_normalise_turns(record), max_length)
    if not any(loss_mask):
        raise _BadRecord(f"no assistant token within max_length={max_length}")
    return Sample(input_ids, loss_mask, source)


def iter_samples(path: Path, chat: ChatTokenizer, max_length: int, on_bad_record: str,
                 bad: BadRecords) -> Iterator[Sample]:
    """Each usable record in file order; a bad one is added to `bad` ("skip") or raises ValueError
    "FILE:LINE: reason" ("fail"). Blank lines are skipped; OSError if the file cannot be read."""
    with open(path, "rb") as f:
        for line_no, raw in _read_lines(f):
            source = f"{path}:{line_no}"
            try:
                sample = _parse_line(raw, line_no, source, chat, max_length)
            except _BadRecord as exc:
                if on_bad_record == "fail":
                    raise ValueError(f"{source}: {exc}") from None
                bad.add(f"{source}: {exc}")
                continue
            if sample is not None:
                yield sample


def load_conversations(path, tokenizer, max_length: int, on_bad_record: str = "skip",
                       chat_template: str | None = None) -> tuple[list[Sample], BadRecords]:
    """Read and tokenise a JSONL file of conversations (bad records: see iter_samples). A missing file
    or one with no usable record raises ValueError naming it."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    bad = BadRecords()
    samples = list(iter_samples(path, ChatTokenizer(tokenizer, chat_template), max_length, on_bad_record, bad))
    if not samples:
        raise _no_usable_records(path, bad)
    return samples, bad


def first_usable_record(path, tokenizer, max_length: int, on_bad_record: str = "skip") -> Sample:
    """Read only up to the first usable record (a launch's preflight); none at all raises ValueError."""
    path, bad = Path(path), BadRecords()
    sample = next(iter_samples(path, ChatTokenizer(tokenizer), max_length, on_bad_record, bad), None)
    if sample is None:
        raise _no_usable_records(path, bad)
    return sample


def _no_usable_records(path: Path, bad: BadRecords) -> ValueError:
    first = f"; first: {bad.examples[0]}" if bad.examples else ""
    return ValueError(f"{path}: no usable records ({bad.count} bad{first})")


@dataclass
class Batch:
    """A right-padded batch of samples."""
    input_ids: torch.Tensor
    """[B, T] int64, right-padded with pad_token_id."""
    attention_mask: torch.Tensor
    """[B, T] int64, 1 on real tokens, 0 on padding."""
    loss_mask: torch.Tensor
    """[B, T] int64, 1 on assistant tokens, 0 elsewhere and on padding."""
    num_tokens: int
    """Real (non-pad) tokens in the batch, computed on the CPU."""


def collate(samples: list[Sample], pad_token_id: int) -> Batch:
    """Right-pad samples into a Batch."""
    def padded(rows: list[list[int]], fill: int) -> torch.Tensor:
        return pad_sequence([torch.tensor(r, dtype=torch.int64) for r in rows], batch_first=True, padding_value=fill)

    ids = [s.input_ids for s in samples]
    return Batch(padded(ids, pad_token_id), padded([[1] * len(r) for r in ids], 0),
                 padded([s.loss_mask for s in samples], 0), num_tokens=sum(map(len, ids)))


class TokenBatcher:
    """Infinite, deterministic Batches with batch_size * longest <= tokens_per_batch: each epoch a
    permutation from (seed, epoch), of which shard r of n takes every n-th sample. A resumed target
    replays the batches it had consumed."""

    def __init__(self, samples: list[Sample], tokens_per_batch: int, pad_token_id: int, seed: int,
                 shard: int = 0, num_shards: int = 1):
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in [0, num_shards), got shard={shard} num_shards={num_shards}")
        if len(samples) < num_shards:
            raise ValueError(f"{len(samples)} samples cannot be split into {num_shards} non-empty shards")
        self.samples, self.tokens_per_batch, self.pad_token_id = samples, tokens_per_batch, pad_token_id
        self.seed, self.shard, self.num_shards = seed, shard, num_shards

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """Sample indices of every batch this shard yields in `epoch`."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
        batches: list[list[int]] = []
        current, longest = [], 0
        for index in order[self.shard::self.num_shards].tolist():
            n = len(self.samples[index].input_ids)
            if current and (len(current) + 1) * max(longest, n) > self.tokens_per_batch:
                batches.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, n)
        batches.append(current)
        return batches

    def __iter__(self) -> Iterator[Batch]:
        for epoch in itertools.count():
            for indices in self.epoch_plan(epoch):
                yield collate([self.samples[i] for i in indices], self.pad_token_id)
