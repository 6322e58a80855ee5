"""Diagnostic: compiled flex vs dense drafter outputs on CUDA, over several real packed batches of
different shapes in a row (does a later call still use its own mask?), fp32 and bf16 autocast."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from dflash.data import TokenBatcher, load_conversations
from dflash.loss import compute_loss
from dflash.model import DFlashDraftModel, draft_config_for_target
from dflash.pack import pack_hidden
from dflash.target import TargetCapture, load_target_head
from dflash.tiny import ensure_builtin


def main() -> int:
    d = ensure_builtin(Path(tempfile.mkdtemp()) / "b", seed=0, num_train=200, num_eval=16)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d.target_dir)
    samples, _ = load_conversations(d.train_path, tok, 256)
    tgt = TargetCapture.from_pretrained(d.target_dir, num_layers=5, device="cuda", dtype=torch.float32)
    head = load_target_head(d.target_dir, "cuda", torch.float32)
    models = {}
    for backend in ("dense", "flex"):
        cfg = draft_config_for_target(head.config, 2, 16, tgt.layer_ids, tok.mask_token_id, attn_backend=backend)
        torch.manual_seed(0)
        models[backend] = DFlashDraftModel(cfg, head.embed_tokens, head.lm_head).cuda()
    models["flex"].load_state_dict(models["dense"].state_dict())
    worst = 0.0
    for i, (batch, tpb) in enumerate(zip(range(4), (2048, 1024, 3000, 700))):
        b = next(iter(TokenBatcher(samples, tpb, tok.pad_token_id, seed=i)))
        layers = tgt(b.input_ids.cuda(), b.attention_mask.cuda())
        p = pack_hidden(layers, b, 0.0, 0, False)
        for autocast in (False, True):
            res = {}
            for name, m in models.items():
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    out = compute_loss(m, p, p.context(0.0), 8, 7.0, torch.Generator().manual_seed(i))
                res[name] = (float(out.loss), float(out.tau_prefix))
            diff = abs(res["flex"][0] - res["dense"][0])
            worst = max(worst, diff if not autocast else 0.0)
            print(f"batch {i} N={p.num_tokens} autocast={autocast}: loss dense {res['dense'][0]:.5f} "
                  f"flex {res['flex'][0]:.5f} (diff {diff:.2e})")
    print(f"worst fp32 loss difference flex vs dense: {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
