"""Write a randomly initialised Qwen3 target of a real model's shape (default Qwen3-8B) with the
built-in tiny tokenizer, for benchmarking dflash-train on GPUs where no real weights can be fetched.

    python3 bench/make_random_target.py --out /tmp/qwen3-8b-random [--layers 36]
Weights are drawn on the GPU (fast) from a fixed seed and saved as bf16 safetensors.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.tiny import build_tiny_tokenizer

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1_000_000.0, tie_word_embeddings=False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    kw = dict(SHAPES[a.shape])
    if a.layers:
        kw["num_hidden_layers"] = a.layers
    tok = build_tiny_tokenizer()
    cfg = Qwen3Config(**kw, torch_dtype="bfloat16", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)
    print(f"wrote {a.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
