"""Check that our drafter checkpoints load into z-lab's reference DFlashDraftModel and compute the same.

Not a test: the reference lives in a separate venv (its package is also called `dflash`).

    python3 bench/check_reference_compat.py [--ref-python /tmp/zlab-venv/bin/python]

Run with the project venv: builds a tiny random Qwen3 target and drafters (full attention, and
sliding-window layers with a window shorter than the context), saves checkpoints with
dflash.checkpoint, records our drafter's block states for one decoding-style block (context
positions 0..n-1, block at n..n+B-1), then re-runs itself under the reference venv, which loads each
checkpoint with DFlashDraftModel.from_pretrained (reporting missing/unexpected keys) and runs the
reference forward on the same inputs. Prints one line per case and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {"full": None, "sliding": 5}


def make(workdir: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.attention import build_layout
    from dflash.checkpoint import save_draft_checkpoint
    from dflash.decode import greedy_generate, speculative_generate
    from dflash.model import DFlashDraftModel, draft_config_for_target
    from dflash.target import default_layer_ids, target_head_from_model

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256)
    target = Qwen3ForCausalLM(cfg).eval()
    target.save_pretrained(workdir / "target")
    head = target_head_from_model(target)
    layer_ids = default_layer_ids(cfg.num_hidden_layers, 3)
    n, bs = 11, 8
    context = torch.randn(n, 3 * cfg.hidden_size)
    last = torch.tensor(17)
    inputs = {"context": context, "last": last}
    trained = train_briefly(target, head, layer_ids, bs)
    for name, window in CASES.items():
        dcfg = draft_config_for_target(cfg, 2, bs, layer_ids, 255, sliding_window=window, attn_backend="dense")
        drafter = DFlashDraftModel(dcfg, head.embed_tokens, head.lm_head)
        drafter.load_state_dict(trained)
        with torch.no_grad():  # non-trivial norm weights so a mis-wired norm shows up
            for mod in drafter.modules():
                if type(mod).__name__ in ("RMSNorm", "Qwen3RMSNorm"):
                    mod.weight.mul_(torch.empty_like(mod.weight).uniform_(0.8, 1.2))
        save_draft_checkpoint(workdir / name, drafter)
        layout = build_layout(torch.zeros(n, dtype=torch.int32), torch.arange(n), torch.zeros(1, dtype=torch.int32),
                              torch.tensor([n]), torch.tensor([n]), bs)
        block = torch.full((1, bs), 255)
        block[0, 0] = last
        with torch.no_grad():
            inputs[name] = drafter(context, block, layout)[:bs].clone()
        prompt = torch.randint(0, 255, (1, 6), generator=torch.Generator().manual_seed(1))
        spec, stats = speculative_generate(target, drafter, prompt, 24, layer_ids)
        assert torch.equal(spec, greedy_generate(target, prompt, 24))
        inputs[f"{name}/decode"] = {"prompt": prompt, "output": spec, "per_step": stats.tokens_per_step}
    torch.save(inputs, workdir / "inputs.pt")


def train_briefly(target, head, layer_ids, bs, steps=60):
    """A drafter trained for a few steps on the target's own greedy continuations, so decoding
    accepts more than the bonus token and the per-step comparison below means something."""
    from types import SimpleNamespace

    import torch

    from dflash.loss import compute_loss
    from dflash.model import DFlashDraftModel, draft_config_for_target
    from dflash.pack import pack_hidden
    from dflash.target import TargetCapture

    seq = torch.randint(0, 255, (16, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(28):
            seq = torch.cat([seq, target(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    mask = torch.ones_like(seq)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    batch = SimpleNamespace(input_ids=seq, attention_mask=mask, loss_mask=loss_mask, num_tokens=seq.numel())
    capture = TargetCapture(target, layer_ids)
    packed = pack_hidden(capture(seq, mask), batch, 0.0, 0, False)
    capture.close()
    drafter = DFlashDraftModel(draft_config_for_target(target.config, 2, bs, layer_ids, 255, attn_backend="dense"),
                               head.embed_tokens, head.lm_head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        out = compute_loss(drafter, packed, packed.context(0.0), 8, 7.0, gen)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    print(f"trained drafter {steps} steps: loss {out.loss.item():.3f}, simulated tau {out.tau.item():.2f}")
    return drafter.state_dict()


def check(workdir: Path) -> int:
    # Our repository root must not shadow the reference package of the same name.
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != REPO]
    import dflash
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM

    print(f"reference dflash from {Path(dflash.__file__).parent}")
    inputs = torch.load(workdir / "inputs.pt")
    target = AutoModelForCausalLM.from_pretrained(workdir / "target", dtype=torch.float32)
    failures = 0
    for name in CASES:
        model, info = DFlashDraftModel.from_pretrained(workdir / name, output_loading_info=True,
                                                       dtype=torch.float32)
        model.eval()
        keys_ok = not info["missing_keys"] and not info["unexpected_keys"]
        print(f"[{name}] config.json: {json.loads((workdir / name / 'config.json').read_text())['architectures']}, "
              f"block_size={model.block_size}, target_layer_ids={model.target_layer_ids}, "
              f"mask_token_id={model.mask_token_id}")
        print(f"[{name}] load: missing={info['missing_keys']} unexpected={info['unexpected_keys']}"
              f" mismatched={info.get('mismatched_keys', [])}")
        ctx = inputs["context"][None]
        n, bs = ctx.shape[1], model.block_size
        block = torch.full((1, bs), model.mask_token_id)
        block[0, 0] = inputs["last"]
        with torch.no_grad():
            ref = model(position_ids=torch.arange(n + bs)[None], noise_embedding=target.model.embed_tokens(block),
                        target_hidden=ctx)[0]
        diff = (ref - inputs[name]).abs().max().item()
        dec = inputs[f"{name}/decode"]
        import time

        import dflash.model as ref_module
        ref_module._cuda_time = time.perf_counter  # their stats timer syncs CUDA; this runs on CPU
        res = ref_module.dflash_generate(model, target, dec["prompt"], 24, None, return_stats=True)
        same_out = torch.equal(res.output_ids, dec["output"])
        same_steps = list(res.acceptance_lengths) == list(dec["per_step"])
        print(f"[{name}] reference dflash_generate with our checkpoint: output equal to ours (= greedy): "
              f"{same_out}; tokens per verify step equal: {same_steps} "
              f"(ours {dec['per_step']}, reference {list(res.acceptance_lengths)})")
        ok = keys_ok and diff < 1e-4 and same_out and same_steps
        failures += not ok
        print(f"[{name}] block states max|ours - reference| = {diff:.3e}  -> {'OK' if ok else 'MISMATCH'}")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-python", default="/tmp/zlab-venv/bin/python")
    ap.add_argument("--check", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.check:
        return check(args.check)
    with tempfile.TemporaryDirectory(dir=os.environ.get("OUT")) as tmp:
        workdir = Path(tmp)
        make(workdir)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return subprocess.run([args.ref_python, str(Path(__file__).resolve()), "--check", str(workdir)],
                              env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
