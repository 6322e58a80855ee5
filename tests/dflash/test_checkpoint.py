"""dflash.checkpoint: reference-format files, identical logits after a round trip, atomic saves."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash.checkpoint as ckpt
from dflash.attention import build_layout
from dflash.model import DFlashDraftModel, draft_config_for_target
from dflash.target import load_target_head

TARGET = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=64)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("target")
    Qwen3ForCausalLM(TARGET).save_pretrained(path)
    return path


def _drafter(target_dir, window=None):
    head = load_target_head(target_dir, "cpu", torch.float32)
    torch.manual_seed(1)
    cfg = draft_config_for_target(TARGET, 2, 4, [1, 3], 63, sliding_window=window)
    return DFlashDraftModel(cfg, head.embed_tokens, head.lm_head), head


def _logits(model):
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(10, 64, generator=g)
    doc = torch.tensor([0] * 6 + [1] * 4, dtype=torch.int32)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
    anchors = torch.tensor([2, 7])
    block = torch.full((2, 4), 63)
    block[:, 0] = torch.tensor([5, 9])
    lay = build_layout(doc, pos, doc[anchors], anchors, pos[anchors], 4)
    with torch.no_grad():
        return model.logits(model(ctx.to(model.fc.weight.dtype), block, lay))


@pytest.mark.parametrize("window", [None, 3])
def test_round_trip_identical_logits_and_state(tmp_path, target_dir, window):
    model, head = _drafter(target_dir, window)
    extra = {"step": 7, "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1e-3}]}}
    path = ckpt.save_draft_checkpoint(tmp_path / "step-7", model, extra)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "training_state.pt"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["num_target_layers"] == 6 and cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    assert cfg["dflash_config"]["mask_token_id"] == 63 and len(cfg["layer_types"]) == 2
    loaded, state = ckpt.load_draft_checkpoint(path, head, "cpu")
    assert torch.equal(_logits(loaded), _logits(model))
    assert state["step"] == 7 and torch.equal(state["optimizer"]["state"][0]["exp_avg"], torch.ones(3))
    assert loaded.config == model.config


def test_bf16_saved_and_loaded_as_bf16(tmp_path, target_dir):
    model, head = _drafter(target_dir)
    model.to(torch.bfloat16)
    path = ckpt.save_draft_checkpoint(tmp_path / "c", model)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, state = ckpt.load_draft_checkpoint(path, head, "cpu")
    assert state is None and loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(_logits(loaded), _logits(model))


def test_failed_save_leaves_nothing(tmp_path, target_dir, monkeypatch):
    model, _ = _drafter(target_dir)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_draft_checkpoint(tmp_path / "c", model)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_previous(tmp_path, target_dir, monkeypatch):
    model, head = _drafter(target_dir)
    path = ckpt.save_draft_checkpoint(tmp_path / "c", model)
    before = (path / "model.safetensors").read_bytes()
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("quota")))
    with pytest.raises(OSError, match="quota"):
        ckpt.save_draft_checkpoint(path, model, {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert (path / "model.safetensors").read_bytes() == before
    monkeypatch.undo()
    ckpt.save_draft_checkpoint(path, model, {"step": 2})  # a successful overwrite replaces it
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    loaded, state = ckpt.load_draft_checkpoint(path, head, "cpu")
    assert state == {"step": 2} and torch.equal(loaded.fc.weight, model.fc.weight)


def test_load_rejects_non_checkpoint(tmp_path, target_dir):
    _, head = _drafter(target_dir)
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        ckpt.load_draft_checkpoint(tmp_path, head, "cpu")


# ----------------------------------------------------------------------------- run checkpoints
class _RunsCode:
    """Unpickling this runs a shell command: what a crafted training_state.pt would hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _run_checkpoint(run_dir, target_dir, step=4, extra=None):
    model, _ = _drafter(target_dir)
    extra = extra or {"step": step, "consumed": {1: step}, "optimizer": {"state": {}, "param_groups": []},
                      "scheduler": {"last_epoch": step}, "config": {"seed": 0}}
    return ckpt.save_run_checkpoint(run_dir / "checkpoints", step, model, extra)


def test_resume_state_round_trip_through_the_one_loader(tmp_path, target_dir):
    path = _run_checkpoint(tmp_path, target_dir, step=4)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000004\n"
    state = ckpt.load_resume_state(tmp_path)
    assert state["step"] == 4 and state["consumed"] == {1: 4} and state["path"] == str(path)
    assert "fc.weight" in state["model"]


def test_a_training_state_that_would_run_code_is_refused(tmp_path, target_dir):
    path = _run_checkpoint(tmp_path, target_dir)
    marker = tmp_path / "pwned"
    torch.save({"step": 4, "consumed": {}, "optimizer": {}, "scheduler": _RunsCode(marker)},
               path / "training_state.pt")
    for load in (lambda: ckpt.load_resume_state(tmp_path), lambda: ckpt.load_training_state(path, mmap=True)):
        with pytest.raises(ckpt.CheckpointError) as e:   # --resume's loader, and the preflight's look
            load()
        assert str(e.value).startswith(f"{path / 'training_state.pt'}: refused: it references ")
        assert "system" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="refused"):
        ckpt.load_draft_checkpoint(path, load_target_head(target_dir, "cpu", torch.float32), "cpu")
    assert not marker.exists()


def test_garbage_and_missing_training_state_are_one_line_errors(tmp_path, target_dir):
    path = _run_checkpoint(tmp_path, target_dir)
    (path / "training_state.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ckpt.CheckpointError, match=r"training_state.pt: unreadable: "):
        ckpt.load_resume_state(tmp_path)
    (path / "training_state.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="training_state.pt: missing"):
        ckpt.load_resume_state(tmp_path)
    assert ckpt.load_resume_state(tmp_path / "elsewhere") is None   # no checkpoint: --resume starts at step 0


def test_a_failed_write_says_why_and_keeps_the_previous_latest(tmp_path, target_dir, monkeypatch):
    import errno

    first = _run_checkpoint(tmp_path, target_dir, step=4)

    def full(*a, **k):   # what safetensors raises on a full disk
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        _run_checkpoint(tmp_path, target_dir, step=8)
    assert str(e.value) == (f"checkpoint {tmp_path / 'checkpoints' / 'step_0000008'} not written: no space "
                            f"left on device (ENOSPC); kept {first} as latest")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000004"]

    def torch_full(obj, f):   # torch.save through a file: the OSError is the RuntimeError's context
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:   # torch's own chaining: the OSError is the context, not the cause
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904

    monkeypatch.undo()
    monkeypatch.setattr(ckpt.torch, "save", torch_full)
    with pytest.raises(ckpt.CheckpointWriteError, match="no space left on device"):
        _run_checkpoint(tmp_path, target_dir, step=8)
    monkeypatch.setattr(ckpt.torch, "save", lambda *a: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):   # not the file system: keeps its traceback
        _run_checkpoint(tmp_path, target_dir, step=8)
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints") == first


def test_stale_partials_of_dead_writers_are_cleaned(tmp_path, target_dir):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()   # a PID that has exited
    d = tmp_path / "checkpoints"
    _run_checkpoint(tmp_path, target_dir, step=4)
    (d / f"step_0000008.tmp-{dead}").mkdir()
    (d / f"latest.tmp-{dead}").write_text("step_0000008\n")
    (d / f"step_0000006.old-{dead}").mkdir()           # moved aside, replacement never arrived
    (d / f"step_0000006.old-{dead}" / "config.json").write_text("{}")
    (d / f"step_0000009.tmp-{os.getpid()}").mkdir()     # a live writer's: left alone
    handled = ckpt.remove_stale_partials(d)
    assert sorted(handled) == sorted([f"step_0000008.tmp-{dead}", f"latest.tmp-{dead}", f"step_0000006.old-{dead}"])
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_0000004", "step_0000006",
                                                   f"step_0000009.tmp-{os.getpid()}"]
    assert (d / "step_0000006" / "config.json").is_file()


def test_a_training_state_in_the_old_plain_pickle_format_is_refused_as_unsafe(tmp_path, target_dir):
    """Issue 34 row 17: torch.save's legacy (non-zip) format was refused with a misleading mmap message."""
    path = _run_checkpoint(tmp_path, target_dir)
    torch.save({"step": 1}, path / "training_state.pt", _use_new_zipfile_serialization=False)
    for load in (lambda: ckpt.load_resume_state(tmp_path), lambda: ckpt.load_training_state(path, mmap=True)):
        with pytest.raises(ckpt.CheckpointError, match=r"training_state.pt: not a safe checkpoint file: refused "
                                                       r"\(a bare pickle, not torch.save's zip format; code could "
                                                       r"run on load\)"):
            load()
