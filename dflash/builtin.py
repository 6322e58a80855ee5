"""Where the target and data come from: the user's paths, or the built-in tiny target and corpus,
built by rank 0 inside the run directory (so the run carries the target it was trained against)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from dflash.config import ConfigError, TrainConfig


@dataclass
class RunPaths:
    target_dir: Path
    """HF directory of the frozen target."""
    data: Path
    """Training conversations (JSONL)."""
    eval_data: Path | None
    """Held-out conversations for evaluation; None: hold out the last records of `data`."""


def prepare(cfg: TrainConfig, run_dir: Path, rank: int, ctrl_group) -> RunPaths:
    """Rank 0 builds the built-ins (idempotent, so --resume reuses them); every rank then agrees. The
    preflight (dflash.preflight, run before any rank under either launcher) has checked the paths."""
    paths: list = [None]
    if rank == 0:
        paths[0] = _prepare_local(cfg, run_dir)
    dist.broadcast_object_list(paths, src=0, group=ctrl_group)
    return paths[0]


def _prepare_local(cfg: TrainConfig, run_dir: Path) -> RunPaths:
    if cfg.model.target_model is not None:
        return RunPaths(Path(cfg.model.target_model), Path(cfg.data.path), None)
    from dflash.tiny import ensure_builtin

    built = ensure_builtin(run_dir / "builtin", seed=cfg.optim.seed, num_train=cfg.data.builtin_conversations,
                           num_eval=max(cfg.data.eval_prompts, 16))
    data = Path(cfg.data.path) if cfg.data.path is not None else built.train_path
    return RunPaths(built.target_dir, data, built.eval_path if cfg.data.path is None else None)


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as e:  # a directory without a usable tokenizer is bad input, not a crash
        raise ConfigError(f"--target-model: cannot load a tokenizer from {target_dir}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def mask_token_id(tokenizer) -> int:
    """The drafter's MASK id: the tokenizer's mask token, else a reserved/pad token."""
    for tid in (tokenizer.mask_token_id, tokenizer.convert_tokens_to_ids("<|mask|>")
                if "<|mask|>" in tokenizer.get_vocab() else None, tokenizer.pad_token_id):
        if tid is not None:
            return int(tid)
    raise ConfigError("--target-model: tokenizer has neither a mask nor a pad token for the drafter's MASK")
