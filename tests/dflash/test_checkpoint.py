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
