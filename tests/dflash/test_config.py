"""Config resolution: flags > env > file > defaults; unknown keys and bad values exit 2 naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash.cli import main
from dflash.config import ConfigError, TrainConfig, field_docs, resolve_config


def test_precedence_flags_over_env_over_file():
    file = {"profile_interval": 5, "max_steps": 7, "split_fc_layers": False}
    env = {"DFLASH_PROFILE_INTERVAL": "9", "DFLASH_SPLIT_FC_LAYERS": "1"}
    cfg = resolve_config(file, env, {"profile_interval": "11"})
    assert cfg.profile_interval == 11.0       # flag wins over env and file
    assert cfg.split_fc_layers is True         # env wins over file
    assert cfg.max_steps == 7                  # file wins over default
    assert resolve_config({}, {}, {}).profile_interval == 60.0


def test_a_flag_overrides_an_invalid_env_value():
    """The flag wins, so the env var it overrides is never read; without the flag it is still an error."""
    env = {"DFLASH_PROFILE_INTERVAL": "abc", "DFLASH_SPLIT_FC_LAYERS": "maybe"}
    cfg = resolve_config({}, env, {"profile_interval": "5", "split_fc_layers": False})
    assert cfg.profile_interval == 5.0 and cfg.split_fc_layers is False
    with pytest.raises(ConfigError, match="env DFLASH_PROFILE_INTERVAL"):
        resolve_config({}, {"DFLASH_PROFILE_INTERVAL": "abc"}, {})


def test_every_field_has_a_docstring():
    import dataclasses

    docs = field_docs()
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(docs)
    assert all(len(d) > 10 for d in docs.values())


@pytest.mark.parametrize("file,env,flags,needle", [
    ({"max_stepz": 3}, {}, {}, "unknown config field 'max_stepz'"),
    ({}, {}, {"max_steps": "0"}, "config field 'max_steps': must be >= 1"),
    ({}, {}, {"max_steps": "ten"}, "--max-steps: field 'max_steps' expects int"),
    ({}, {"DFLASH_PROFILE_INTERVAL": "soon"}, {}, "env DFLASH_PROFILE_INTERVAL: field 'profile_interval'"),
    ({}, {"DFLASH_SPLIT_FC_LAYERS": "maybe"}, {}, "env DFLASH_SPLIT_FC_LAYERS: field 'split_fc_layers'"),
    ({}, {}, {"transfer": "carrier-pigeon"}, "config field 'transfer': must be auto, nccl or host"),
    ({}, {}, {"data": "/nonexistent.jsonl"}, "config field 'data': no such file"),
    ({"lr": True}, {}, {}, "field 'lr' expects float"),
    ({}, {}, {"profile_interval": "inf"}, "config field 'profile_interval': must be a finite number (got inf)"),
    ({"lr": "nan"}, {}, {}, "config field 'lr': must be > 0"),
    ({}, {}, {"gamma": "-inf"}, "config field 'gamma': must be > 0"),
    ({}, {}, {"hidden_noise": "1e999"}, "config field 'hidden_noise': must be a finite number"),
    ({}, {}, {"rendezvous_timeout_s": "0"}, "config field 'rendezvous_timeout_s': must be > 0"),
])
def test_bad_values_name_the_field(file, env, flags, needle):
    with pytest.raises(ConfigError) as e:
        resolve_config(file, env, flags)
    assert needle in str(e.value)


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_steps: 3\nblock_sise: 8\n")
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dflash-train: error: {cfg}: unknown config field 'block_sise'"]
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    assert main(["--config", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["--resume"]) == 2
    assert "--resume: needs --run-dir" in capsys.readouterr().err


def test_console_script_exit_code_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--num-anchors", "-3"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "dflash-train: error: config field 'num_anchors': must be >= 1 (got -3)"
    assert "Traceback" not in r.stderr


def test_every_dflash_variable_lands_in_the_config():
    env = {"DFLASH_FUSED_ELEMENTWISE": "0", "DFLASH_FUSED_CE": "off", "DFLASH_FAULT": "crash@target.fwd:step=2"}
    cfg = resolve_config({}, env, {})
    assert (cfg.fused_elementwise, cfg.fused_ce, cfg.fault) == (False, False, "crash@target.fwd:step=2")
    assert resolve_config({}, {}, {}).to_dict()["fused_ce"] is True
