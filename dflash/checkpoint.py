"""Drafter checkpoints a DFlash inference stack loads: config.json + model.safetensors (+ training state).

Written into PATH.tmp-PID, fsynced, then renamed into place, so PATH is never half-written; `latest`
names the newest RUN_DIR/checkpoints/step_N. `training_state.pt` is read with weights_only=True, so a
crafted file cannot run code.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.config import ConfigError
from dflash.model import DFlashConfig, DFlashDraftModel
from profiler.control import pid_alive

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
STATE_NAME = "training_state.pt"
LATEST_NAME = "latest"
# What a writer leaves behind when it dies mid-save: PATH.tmp-PID (new, incomplete), PATH.old-PID
# (the previous checkpoint moved aside), latest.tmp-PID (the pointer being replaced).
_PARTIAL = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded, or must not be: one line that names the file."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written; the message says why and which one is kept."""


class NonfiniteCheckpointError(CheckpointWriteError):
    """A checkpoint refused because a parameter holds a NaN or Inf (never written, never `latest`)."""


def nonfinite_parameter(model: torch.nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or Inf, or None: exact, so one deliberate sync."""
    named = list(model.named_parameters())
    if not named:
        return None
    flags = torch.stack([~torch.isfinite(p.detach()).all() for _, p in named])
    bad = flags.nonzero().flatten().tolist()   # the deliberate sync
    return named[bad[0]][0] if bad else None


def _fsync(path: Path) -> None:
    """A file's or a directory's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_draft_checkpoint(path, model: DFlashDraftModel, extra_state: dict | None = None) -> Path:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f"{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
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
            # Through a Python file: a failed write then keeps its OSError (as __context__); with a
            # path, torch reports a full disk only as "unexpected pos".
            with open(tmp / STATE_NAME, "wb") as f:
                torch.save(extra_state, f)
            names.append(STATE_NAME)
        for name in names:
            _fsync(tmp / name)
        _fsync(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def save_run_checkpoint(ckpt_dir: Path, step: int, model: DFlashDraftModel, extra_state: dict) -> Path:
    """RUN_DIR/checkpoints/step_N, then `latest` pointed at it (both atomic). A non-finite parameter or a
    file-system failure is a CheckpointWriteError saying which checkpoint is still latest."""
    path = ckpt_dir / f"step_{step:07d}"
    latest = ckpt_dir / LATEST_NAME
    tmp = latest.with_name(f"{LATEST_NAME}.tmp-{os.getpid()}")

    def kept() -> str:
        last = latest_checkpoint(ckpt_dir)
        return f"kept {last}" if last else "no earlier checkpoint"

    bad = nonfinite_parameter(model)
    if bad is not None:
        raise NonfiniteCheckpointError(f"checkpoint {path} not written: parameter {bad} holds NaN/Inf; "
                                       f"{kept()} as latest")
    try:
        save_draft_checkpoint(path, model, extra_state=extra_state)
        tmp.write_text(path.name + "\n")
        tmp.replace(latest)
    except Exception as e:
        code = _errno_of(e)
        if code is None:
            raise
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(
            f"checkpoint {path} not written: {os.strerror(code).lower()} ({errno.errorcode.get(code, code)}); "
            f"{kept()} as latest") from None
    return path


def _errno_of(exc: BaseException | None) -> int | None:
    """The errno of an OSError in the chain, or of safetensors' "(os error N)" message."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        found = re.search(r"os error (\d+)", str(exc))
        if found:
            return int(found.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none (or it names a missing one)."""
    pointer = Path(ckpt_dir) / LATEST_NAME
    if not pointer.is_file():
        return None
    path = Path(ckpt_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def remove_stale_partials(ckpt_dir: Path) -> list[str]:
    """Clean what dead writers left in `ckpt_dir` (.tmp-PID / .old-PID, PID not alive): a partial new
    checkpoint is deleted, a moved-aside one whose replacement never arrived put back. Returns the names."""
    handled = []
    if not Path(ckpt_dir).is_dir():
        return handled
    for entry in sorted(Path(ckpt_dir).iterdir()):
        m = _PARTIAL.match(entry.name)
        if m is None or pid_alive(int(m["pid"])):
            continue
        target = entry.with_name(m["name"])
        if m["kind"] == "old" and not target.exists():
            os.replace(entry, target)
        elif entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        handled.append(entry.name)
    return handled


def _bare_pickle(path: Path) -> bool:
    """A pickle outside torch.save's zip format (the legacy format, or pickle.dump): what we never write."""
    if not path.is_file() or zipfile.is_zipfile(path):
        return False
    with path.open("rb") as f:
        return f.read(1) == b"\x80"   # the pickle PROTO opcode


def load_training_state(ckpt_path: Path, mmap: bool = False) -> dict:
    """training_state.pt of a checkpoint as plain data (weights_only=True; `mmap` maps tensors
    instead of reading them, for a cheap check). CheckpointError when unsafe or unreadable."""
    path = Path(ckpt_path) / STATE_NAME
    if _bare_pickle(path):
        raise CheckpointError(f"{path}: not a safe checkpoint file: refused (a bare pickle, not torch.save's zip "
                              "format; code could run on load)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(f"{path}: refused: it references {found.group(1)}, which loading could "
                                  "execute; only tensors and plain data are loaded") from None
        why = [line for line in str(e).split("WeightsUnpickler error:")[-1].splitlines() if line.strip()]
        raise CheckpointError(f"{path}: unreadable: not a torch.save file of plain data"
                              f"{' (' + why[0].strip() + ')' if why else ''}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint has no training state to resume)") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: unreadable: {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a training state (a {type(state).__name__}, not a dict)")
    return state


def check_weights_header(path: Path) -> None:
    """CheckpointError (one line naming `path`) unless it is a safetensors file whose header parses and whose
    tensors lie inside the file: what loading it needs, read without reading the tensors."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint has no weights to resume)")
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors parses the header and checks the offsets: no code runs
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: unreadable: {first}") from None


def load_resume_state(run_dir: Path) -> dict | None:
    """The latest checkpoint's training state plus its model weights ("model") and path ("path"); None
    when the run directory has no checkpoint."""
    path = latest_checkpoint(Path(run_dir) / "checkpoints")
    if path is None:
        return None
    state = load_training_state(path)
    missing = [k for k in ("step", "consumed", "optimizer", "scheduler") if k not in state]
    if missing:
        raise CheckpointError(f"{path / STATE_NAME}: not a training state (no {', '.join(missing)})")
    try:
        state["model"] = load_file(str(path / WEIGHTS_NAME), device="cpu")
    except Exception as e:  # safetensors parses a header and maps tensors: no code runs
        raise CheckpointError(f"{path / WEIGHTS_NAME}: unreadable: {str(e).splitlines()[0]}") from None
    state["path"] = str(path)
    return state


def load_draft_checkpoint(path, head, device, attn_backend: str = "auto"):
    """-> (drafter on `device` in the saved dtype, training state or None). `head` is a TargetHead."""
    path = Path(path)
    cfg_path, w_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_path.exists() or not w_path.exists():
        raise ValueError(f"{path}: not a drafter checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    config = DFlashConfig.from_json_dict(json.loads(cfg_path.read_text()), attn_backend=attn_backend)
    state = load_file(str(w_path), device="cpu")
    model = DFlashDraftModel(config, head.embed_tokens, head.lm_head)
    model.to(dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{w_path}: missing {sorted(missing)[:3]} unexpected {sorted(unexpected)[:3]}")
    model.to(device)
    extra = load_training_state(path) if (path / STATE_NAME).exists() else None
    return model, extra
