"""dflash.target: layer capture with early stop, frozen target, head loading from safetensors."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from dflash.target import TargetCapture, default_layer_ids, load_target_head


def _config(tied=False):
    return Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=128, tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(_config()).eval()


def test_default_layer_ids_match_reference_formula():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(8, 3) == [1, 3, 5]
    assert default_layer_ids(28, 1) == [14]
    with pytest.raises(ValueError):
        default_layer_ids(8, 0)


def test_capture_equals_hf_hidden_states_and_stops_early(target):
    cap = TargetCapture(target, [1, 3, 5])
    ran = []
    target.model.layers[6].register_forward_hook(lambda *a: ran.append("layer6"))
    target.model.norm.register_forward_hook(lambda *a: ran.append("norm"))
    target.lm_head.register_forward_hook(lambda *a: ran.append("lm_head"))
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, 6:] = 0
    layers = cap(ids, mask)
    assert ran == []  # nothing after the deepest captured layer ran
    assert all(not t.requires_grad for t in layers)
    ref = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states  # hooks inactive here
    assert ran == ["layer6", "norm", "lm_head"]
    for t, i in zip(layers, [1, 3, 5]):
        assert t.shape == (2, 9, 32)
        torch.testing.assert_close(t, ref[i + 1], rtol=0, atol=0)


def test_target_is_frozen_and_eval(target):
    cap = TargetCapture(target, [2])
    assert not cap.model.training
    assert all(not p.requires_grad for p in cap.model.parameters())
    assert cap.hidden_size == 32 and cap.layer_ids == [2]
    n_hooks = len(cap.model.model.layers[2]._forward_hooks)
    cap.close()
    assert len(cap.model.model.layers[2]._forward_hooks) == n_hooks - 1


def test_base_model_layers_and_bad_layer_ids():
    torch.manual_seed(0)
    base = Qwen3Model(_config()).eval()
    out = TargetCapture(base, [0, 2])(torch.randint(0, 128, (1, 5)), torch.ones(1, 5, dtype=torch.int64))
    assert len(out) == 2 and out[0].shape == (1, 5, 32)
    with pytest.raises(ValueError, match="layer_ids"):
        TargetCapture(base, [1, 8])
    with pytest.raises(ValueError, match="layer_ids"):
        TargetCapture(base, [3, 1])


def test_from_pretrained_default_ids(tmp_path, target):
    target.save_pretrained(tmp_path / "t")
    cap = TargetCapture.from_pretrained(tmp_path / "t", num_layers=3)
    assert cap.layer_ids == [1, 3, 5]
    ids = torch.randint(0, 128, (1, 6))
    got = cap(ids, torch.ones(1, 6, dtype=torch.int64))
    ref = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got[2], ref[6])


@pytest.mark.parametrize("tied,sharded", [(False, False), (True, False), (False, True)])
def test_load_target_head(tmp_path, tied, sharded):
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(_config(tied))
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    head = load_target_head(tmp_path, "cpu", torch.float32)
    torch.testing.assert_close(head.embed_tokens.weight, model.model.embed_tokens.weight)
    torch.testing.assert_close(head.lm_head.weight, model.lm_head.weight)
    if tied:
        assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad
    x = torch.randn(3, 32)
    torch.testing.assert_close(head.lm_head(x), model.lm_head(x))


def test_load_target_head_missing_files(tmp_path):
    _config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_target_head(tmp_path, "cpu", torch.float32)
