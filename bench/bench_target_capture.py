"""Target capture at Qwen3-8B shapes: hooks + early stop vs output_hidden_states=True.

    python3 bench/bench_target_capture.py [--repeats 8]

A Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, intermediate 12288, vocab 151936)
with random bf16 weights, built on the meta device and materialised directly on the GPU. Input
2 x 4096 tokens. Rows: TargetCapture (hooks on K=5 layers, stop after layer 33: no later layers, no
norm, no LM head); the full model with output_hidden_states=True (the usual way, LM head over every
token); the same with logits_to_keep=1 (LM head on the last token only). Writes
bench_target_capture.json under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash.target import TargetCapture, default_layer_ids

BATCH, SEQ = 2, 4096


def build_target(device) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    # to_empty left the RoPE buffers uninitialised: a fresh float32 rotary module, as HF builds it.
    model.model.rotary_emb = Qwen3RotaryEmbedding(cfg).to(device)
    return model.eval().requires_grad_(False)


def time_fn(fn, repeats: int, warmup: int = 2) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # benchmark timing sync
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_target_capture: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model = build_target(device)
    layer_ids = default_layer_ids(36, 5)
    ids = torch.randint(0, 151936, (BATCH, SEQ), device=device)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64, device=device)
    capture = TargetCapture(model, layer_ids)
    ref = [None]

    def full(keep):
        def run():
            with torch.no_grad():
                out = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True,
                            logits_to_keep=keep)
                ref[0] = [out.hidden_states[i + 1] for i in layer_ids]
        return run

    got = capture(ids, mask)
    full(1)()
    match = all(torch.equal(a, b) for a, b in zip(got, ref[0]))
    close = all(torch.allclose(a, b, atol=1e-2, rtol=1e-2) for a, b in zip(got, ref[0]))
    rows = []
    for name, fn in [("hooks + early stop", lambda: capture(ids, mask)),
                     ("output_hidden_states", full(0)),
                     ("output_hidden_states, logits_to_keep=1", full(1))]:
        torch.cuda.reset_peak_memory_stats(device)
        ms = statistics.median(time_fn(fn, args.repeats))
        rows.append({"variant": name, "median_ms": ms, "tokens_per_s": BATCH * SEQ / (ms / 1e3),
                     "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30})
    print(f"target capture, Qwen3-8B shape, bf16, {BATCH}x{SEQ} tokens, layers {layer_ids}; "
          f"captured layers bitwise identical to output_hidden_states: {match} (allclose: {close})")
    print(f"{'variant':<42}{'median ms':>10}{'tokens/s':>11}{'speed-up':>10}{'peak GiB':>10}")
    base = rows[1]["median_ms"]
    for r in rows:
        print(f"{r['variant']:<42}{r['median_ms']:>10.1f}{r['tokens_per_s']:>11.0f}"
              f"{base / r['median_ms']:>9.2f}x{r['peak_mem_gib']:>10.1f}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_target_capture.json").write_text(json.dumps({"match": match, "close": close, "rows": rows}, indent=2))
    return 0 if close else 1


if __name__ == "__main__":
    sys.exit(main())
