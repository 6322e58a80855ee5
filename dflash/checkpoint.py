"""Drafter checkpoints a DFlash inference stack loads: config.json + model.safetensors (+ training state).

Written into PATH.tmp-PID, every file fsynced, then renamed into place; a failure at any point
removes the temporary directory, so PATH is either the previous checkpoint or the new one, never
half-written. Replacing an existing PATH moves the old one aside first and deletes it afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.model import DFlashConfig, DFlashDraftModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
STATE_NAME = "training_state.pt"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_draft_checkpoint(path, model: DFlashDraftModel, extra_state: dict | None = None) -> Path:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f"{path.name}.old-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        config = model.config.to_json_dict()
        config["dtype"] = str(model.fc.weight.dtype).removeprefix("torch.")
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        # contiguous clones on the CPU: safetensors refuses shared/non-contiguous storage.
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        names = [CONFIG_NAME, WEIGHTS_NAME]
        if extra_state is not None:
            torch.save(extra_state, tmp / STATE_NAME)
            names.append(STATE_NAME)
        for name in names:
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def load_draft_checkpoint(path, head, device, attn_backend: str = "auto"):
    """-> (drafter on `device` in the saved dtype, training state or None). `head` is a TargetHead."""
    path = Path(path)
    cfg_path, w_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_path.exists() or not w_path.exists():
        raise ValueError(f"{path}: not a drafter checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    config = DFlashConfig.from_json_dict(json.loads(cfg_path.read_text()), attn_backend=attn_backend)
    state = load_file(str(w_path), device="cpu")
    model = DFlashDraftModel(config, head.embed_tokens, head.lm_head)
    dtype = next(iter(state.values())).dtype
    model.to(dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{w_path}: missing {sorted(missing)[:3]} unexpected {sorted(unexpected)[:3]}")
    model.to(device)
    extra = None
    if (path / STATE_NAME).exists():
        extra = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
    return model, extra
