"""The built-in default, needing no files and no network: a tiny Qwen3 target and a train / held-out
corpus of its own greedy continuations (as DFlash training regenerates responses with the target), so
simulated acceptance during training matches real draft-and-verify acceptance.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.topology import intra_op_threads

# Bump when anything below changes what gets built, so stale cached builds are rebuilt.
BUILD_VERSION = 2
MARKER_NAME = ".dflash_tiny_target.json"

PAD, EOS, IM_START, IM_END, MASK, UNK = (
    "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<unk>")
SPECIAL_TOKENS = [PAD, EOS, IM_START, IM_END, MASK, UNK]

# ChatML as Qwen models use it (no default system prompt).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NUMBERS = [str(i) for i in range(100)]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown"]
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen", "bat", "rat",
           "yak", "elk", "ant", "eel", "ape", "emu"]
FRUITS = ["apple", "pear", "plum", "fig", "lime", "kiwi", "date", "grape"]
WORDS = ["user", "assistant", "system", "you", "are", "a", "helpful", "tiny", "model", "count",
         "from", "to", "down", "up", "by", "repeat", "times", "the", "phrase", "list", "spell",
         "continue", "pattern", "add", "plus", "minus", "is", "what", "comes", "after", "before",
         "next", "copy", "words", "numbers", "letters", "colors", "animals", "fruits", "sort",
         "reverse", "and", "then", "please", "say", "of", "in", "step", "answer", "short",
         "long", "story", "about", "big", "small", "quick", "slow", "jumps", "over", "lazy",
         ".", ",", "?", "!", ":"]
VOCAB_WORDS = WORDS + NUMBERS + LETTERS + COLORS + ANIMALS + FRUITS

# Tokens the target must never emit (they would not round-trip through the corpus text): their
# LM-head rows are zeroed, and a zero logit never wins. <|im_end|> stays: it ends the turn.
NON_GENERABLE = [PAD, EOS, IM_START, MASK, UNK]


def build_tiny_tokenizer():
    """A word-level PreTrainedTokenizerFast over the synthetic vocabulary, with a ChatML template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIAL_TOKENS + list(dict.fromkeys(VOCAB_WORDS))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Whitespace-only splitting: decode joins words with one space, so decode -> encode round-trips.
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK, pad_token=PAD, eos_token=EOS, mask_token=MASK)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _tiny_config(tokenizer):
    from transformers import Qwen3Config

    vocab_size = -(-len(tokenizer) // 8) * 8
    stop_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=INIT_STD,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids, bos_token_id=None)


# Weight init scales: 0.03 keeps continuations context-dependent yet learnable in a CPU-minutes
# run (smaller is a bigram table, larger chaotic). The LM head is larger so the softmax is not near
# uniform (a drafter sharing the frozen head could not express confidence); it changes no argmax.
INIT_STD = 0.03
LM_HEAD_STD = 0.25
EMBED_STD = 1.0


def _init_weights(model, seed: int, tokenizer) -> None:
    """Deterministic init from `seed`, independent of the transformers version's own init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = EMBED_STD if "embed_tokens" in name else LM_HEAD_STD if name.startswith("lm_head") else INIT_STD
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        banned = [tokenizer.convert_tokens_to_ids(t) for t in NON_GENERABLE]
        banned += list(range(len(tokenizer), model.config.vocab_size))   # rounding padding rows
        model.lm_head.weight[banned] = 0.0


def make_tiny_model(seed: int = 0):
    """(Qwen3ForCausalLM, tokenizer) of the tiny target, in memory, deterministic in `seed`."""
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = _tiny_config(tokenizer)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    _init_weights(model, seed, tokenizer)
    model.generation_config.update(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                   do_sample=False)
    return model, tokenizer


_OWN_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "added_tokens.json",
              MARKER_NAME}


def build_tiny_target(out_dir, seed: int = 0) -> Path:
    """Build (once) a random Qwen3ForCausalLM + tokenizer in HF format at `out_dir`: a complete build
    whose marker matches seed and version is reused; written to a sibling and renamed into place."""
    out_dir = Path(out_dir)
    expected = {"seed": seed, "version": BUILD_VERSION}
    marker = out_dir / MARKER_NAME
    complete = all((out_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
    if complete and marker.is_file() and json.loads(marker.read_text()) == expected:
        return out_dir
    if out_dir.exists():
        foreign = [p.name for p in out_dir.iterdir() if p.name not in _OWN_FILES]
        if not out_dir.is_dir() or foreign:
            raise ValueError(f"{out_dir}: exists and is not a tiny-target build (has {foreign[:3]})")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model, tokenizer = make_tiny_model(seed)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER_NAME).write_text(json.dumps(expected))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def _make_prompt(rng: random.Random) -> list[dict]:
    """One synthetic user request (optionally after a system turn) with regular structure."""
    kind = rng.randrange(7)
    if kind == 0:
        a = rng.randrange(0, 80)
        text = f"count from {a} to {a + rng.randrange(3, 20)}"
    elif kind == 1:
        a = rng.randrange(20, 100)
        text = f"count down from {a} to {a - rng.randrange(3, 20)}"
    elif kind == 2:
        phrase = " ".join(rng.choice(COLORS + ANIMALS + FRUITS) for _ in range(rng.randrange(1, 4)))
        text = f"repeat the phrase {phrase} {rng.randrange(2, 6)} times"
    elif kind == 3:
        word = rng.choice(ANIMALS + FRUITS + COLORS)
        text = f"spell {word} : " + " ".join(word[: rng.randrange(1, len(word) + 1)])
    elif kind == 4:
        unit = [rng.choice(LETTERS + COLORS) for _ in range(rng.randrange(2, 4))]
        text = "continue the pattern " + " ".join((unit * 4)[: len(unit) * 2 + rng.randrange(len(unit))])
    elif kind == 5:
        text = f"what is {rng.randrange(50)} plus {rng.randrange(50)} ?"
    else:
        pool = rng.choice([COLORS, ANIMALS, FRUITS, NUMBERS])
        text = "sort " + " ".join(rng.sample(pool, rng.randrange(3, 7)))
    messages = [{"role": "user", "content": text}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "you are a helpful tiny model ."})
    return messages


MIN_NEW_TOKENS, MAX_NEW_TOKENS = 32, 96
GENERATE_BATCH = 256


@torch.no_grad()
@intra_op_threads(1)   # the ops are tiny
def build_builtin_corpus(target_dir, out_path, num_conversations: int, seed: int, exclude_from=None) -> Path:
    """Write JSONL conversations whose assistant turn is the target's greedy continuation, skipping the
    prompts of `exclude_from` (a held-out split), on one thread."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_path = Path(out_path)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    stop_ids = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id}
    excluded = set()
    if exclude_from is not None:
        with open(exclude_from) as f:
            excluded = {json.dumps(json.loads(line)["messages"][:-1]) for line in f if line.strip()}
    rng = random.Random(seed)
    records: list[dict] = []
    while len(records) < num_conversations:
        wanted = num_conversations - len(records)
        prompts = []
        while len(prompts) < wanted + wanted // 32 + 2:   # spares for empty continuations
            messages = _make_prompt(rng)
            if json.dumps(messages) not in excluded:
                prompts.append((messages, rng.randint(MIN_NEW_TOKENS, MAX_NEW_TOKENS)))
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                 for m, _ in prompts]
        # Chunks of similar budgets: generate runs every row until the chunk's largest budget.
        by_budget = sorted(range(len(prompts)), key=lambda i: prompts[i][1])
        generated = [None] * len(prompts)
        for start in range(0, len(by_budget), GENERATE_BATCH):
            chunk = by_budget[start:start + GENERATE_BATCH]
            # Left padding, masked; greedy continuations are prefix-consistent, so one call with the
            # chunk's largest budget, cut per row, equals a call per row (test_tiny re-checks rows).
            enc = tokenizer([texts[i] for i in chunk], add_special_tokens=False, padding=True,
                            padding_side="left", return_tensors="pt")
            out = model.generate(
                input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                max_new_tokens=prompts[chunk[-1]][1], do_sample=False,
                eos_token_id=sorted(stop_ids), pad_token_id=tokenizer.pad_token_id)
            width = enc["input_ids"].shape[1]
            for i, row in zip(chunk, out[:, width:].tolist()):
                generated[i] = _cut_continuation(row[:prompts[i][1]], stop_ids)
        for (messages, _), new_ids in zip(prompts, generated):
            if new_ids and len(records) < num_conversations:
                reply = tokenizer.decode(new_ids, skip_special_tokens=False)
                records.append({"messages": messages + [{"role": "assistant", "content": reply}]})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, out_path)
    return out_path


def _cut_continuation(ids: list[int], stop_ids: set[int]) -> list[int]:
    """Content tokens of a greedy continuation: up to (not incl.) the first stop token."""
    return next((ids[:i] for i, tok in enumerate(ids) if tok in stop_ids), ids)


@dataclass
class BuiltinData:
    """Paths of the built-in default: target model directory and train / held-out eval corpora."""
    target_dir: Path
    """HF directory of the tiny Qwen3 target (model + tokenizer)."""
    train_path: Path
    """JSONL training conversations."""
    eval_path: Path
    """JSONL held-out conversations (different seed, no prompt shared with train)."""


CORPUS_MARKER = ".dflash_builtin_corpus.json"
BUILTIN_FILES = ("tiny-target", "train.jsonl", "eval.jsonl", CORPUS_MARKER)
"""What a built-in build directory holds (RUN_DIR/builtin, or a user-cache entry: dflash/builtin.py)."""


def builtin_settings(seed: int, num_train: int, num_eval: int) -> dict:
    """Everything a built-in build depends on: its marker's content, and what its cache key is made from."""
    return {"seed": seed, "num_train": num_train, "num_eval": num_eval, "version": BUILD_VERSION}


def builtin_data(build_dir) -> BuiltinData:
    """The paths of the built-ins under `build_dir` (built or not)."""
    build_dir = Path(build_dir)
    return BuiltinData(build_dir / "tiny-target", build_dir / "train.jsonl", build_dir / "eval.jsonl")


def builtin_complete(build_dir, settings: dict) -> bool:
    """Whether `build_dir` holds a whole build made with `settings` (both markers match, every file there)."""
    data, build_dir = builtin_data(build_dir), Path(build_dir)
    try:
        corpus = json.loads((build_dir / CORPUS_MARKER).read_text())
        target = json.loads((data.target_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (corpus == settings and target == {"seed": settings["seed"], "version": settings["version"]}
            and data.train_path.is_file() and data.eval_path.is_file()
            and all((data.target_dir / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json")))


def ensure_builtin(cache_dir, seed: int = 0, num_train: int = 1000, num_eval: int = 64) -> BuiltinData:
    """Build (once) the tiny target and both corpora under `cache_dir`; reuse a matching build."""
    cache_dir = Path(cache_dir)
    expected = builtin_settings(seed, num_train, num_eval)
    if builtin_complete(cache_dir, expected):
        return builtin_data(cache_dir)
    target_dir = build_tiny_target(cache_dir / "tiny-target", seed=seed)
    data = BuiltinData(target_dir, cache_dir / "train.jsonl", cache_dir / "eval.jsonl")
    marker = cache_dir / CORPUS_MARKER
    build_builtin_corpus(target_dir, data.train_path, num_train, seed=seed)
    build_builtin_corpus(target_dir, data.eval_path, num_eval, seed=seed + 1_000_003,
                         exclude_from=data.train_path)
    marker.write_text(json.dumps(expected))
    return data
