"""End-of-run evaluation on held-out conversations: real greedy draft-and-verify decoding (lossless:
it must equal target-only greedy decoding) beside the simulated acceptance length (`tau_prefix`
teacher-forced; `tau`, which assumes positions fail independently) on the same conversations."""

from __future__ import annotations

import sys

import torch

import profiler
from dflash.data import TokenBatcher
from dflash.decode import greedy_generate, speculative_generate
from dflash.loss import compute_loss
from dflash.pack import pack_hidden
from dflash.target import TargetCapture
from dflash.topology import intra_op_threads


def split_heldout(samples: list, n: int) -> tuple[list, list]:
    """Hold out the last n records (used when the data has no separate held-out file)."""
    if n <= 0 or len(samples) <= n:
        return samples, []
    return samples[:-n], samples[-n:]


def _stop_token_ids(tokenizer, target) -> list[int]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    ids = [*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id]
    return sorted({int(i) for i in ids if i is not None})


def _prompt_length(sample) -> int:
    """Tokens before the first assistant token: the prompt the decoder starts from."""
    return next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.input_ids))


@torch.no_grad()
def run_eval(ctx, model, heldout: list, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    cfg, device = ctx.cfg, ctx.device
    model.eval()
    # A bf16 target feeds bf16 features to the float32 drafter, as in training: same autocast.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"
                              and ctx.dtype == torch.bfloat16)
    # Decoding is latency-bound (batch 1): on the CPU extra intra-op threads only add wake-ups.
    with intra_op_threads(1 if device.type == "cpu" else None), profiler.span("eval.decode"), autocast:
        # The training dtype: the drafter is scored on the features it learned from.
        target = AutoModelForCausalLM.from_pretrained(str(ctx.target_dir), dtype=ctx.dtype).to(device).eval()
        layer_ids = list(model.config.target_layer_ids)
        stops = _stop_token_ids(tokenizer, target)
        taus, mismatches, produced = [], 0, 0
        prompts = heldout[:cfg.data.eval_prompts]
        for sample in prompts:
            if ctx.stop_requested():   # a stop skips what is left of the evaluation
                _stopped(ctx, len(taus), len(prompts))
                model.train()
                return
            n = _prompt_length(sample)
            prompt = torch.tensor([sample.input_ids[:n]], device=device)
            ref = greedy_generate(target, prompt, cfg.data.eval_new_tokens, stops)
            out, stats = speculative_generate(target, model, prompt, cfg.data.eval_new_tokens, layer_ids, stops)
            mismatches += int(not torch.equal(out, ref))
            taus.append(stats.acceptance_length)
            produced += out.shape[-1] - n
        simulated, simulated_independent = _simulated_tau(ctx, model, target, layer_ids, heldout)
    result = {"prompts": len(taus), "measured_tau": sum(taus) / max(1, len(taus)),
              "simulated_tau": simulated, "simulated_tau_independent": simulated_independent,
              "lossless": mismatches == 0, "mismatches": mismatches, "generated_tokens": produced}
    profiler.event("eval", **result)
    print(f"eval: acceptance length {result['measured_tau']:.2f} measured by draft-and-verify decoding "
          f"({result['prompts']} held-out prompts, {'lossless' if result['lossless'] else 'NOT LOSSLESS'}) "
          f"vs {simulated:.2f} simulated teacher-forced on the same conversations (per-anchor prefix; "
          f"{simulated_independent:.2f} by the independent-positions formula)",
          file=sys.stderr if mismatches else sys.stdout)
    model.train()


def _stopped(ctx, done: int, total: int) -> None:
    """A signal came during the evaluation: no result (a part of the prompts would be another figure)."""
    signame = getattr(ctx.stop_requested, "name", None) or "a signal"
    profiler.event("eval_skipped", reason=f"stopped by {signame} after {done} of {total} held-out prompts")


def _simulated_tau(ctx, model, target, layer_ids, heldout) -> float:
    """Teacher-forced acceptance on the held-out conversations, exactly as training measures it."""
    capture = TargetCapture(target, layer_ids)
    batcher = TokenBatcher(heldout[:ctx.cfg.data.eval_prompts], ctx.cfg.data.tokens_per_batch, ctx.pad_token_id, seed=0)
    batch = next(iter(batcher))
    layers = capture(batch.input_ids.to(ctx.device), batch.attention_mask.to(ctx.device))
    packed = pack_hidden(layers, batch, 0.0, 0, False)
    out = compute_loss(model, packed, packed.context(0.0), ctx.cfg.optim.num_anchors * 4, ctx.cfg.optim.gamma,
                       torch.Generator().manual_seed(0), ctx.cfg.model.fused_ce)
    # End-of-run evaluation: host syncs here are fine.
    return float(out.tau_prefix), float(out.tau)
