"""Config resolution: flags > env > file > defaults, in sections; unknown keys and bad values exit 2
naming the field as section.field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash.cli import build_parser, main
from dflash.config import SECTIONS, ConfigError, TrainConfig, config_from_args, field_docs, resolve_config


def test_precedence_flags_over_env_over_file():
    file = {"profile": {"interval_s": 5}, "optim": {"max_steps": 7}, "parallel": {"split_fc_layers": False}}
    env = {"DFLASH_PROFILE_INTERVAL": "9", "DFLASH_SPLIT_FC_LAYERS": "1"}
    cfg = resolve_config(file, env, {"profile_interval": "11"})
    assert cfg.profile.interval_s == 11.0              # flag wins over env and file
    assert cfg.parallel.split_fc_layers is True         # env wins over file
    assert cfg.optim.max_steps == 7                     # file wins over default
    assert resolve_config({}, {}, {}).profile.interval_s == 60.0


def test_a_file_takes_sections_or_flat_flag_keys_but_not_one_field_twice():
    flat = resolve_config({"profile_interval": 5, "lr": 0.01, "data": None, "run_dir": "r"}, {}, {})
    nested = resolve_config({"profile": {"interval_s": 5}, "optim": {"lr": 0.01}, "run_dir": "r"}, {}, {})
    assert flat == nested and flat.optim.lr == 0.01 and flat.data.path is None
    with pytest.raises(ConfigError, match="config field 'optim.lr' given twice"):
        resolve_config({"lr": 0.01, "optim": {"lr": 0.02}}, {}, {})
    with pytest.raises(ConfigError, match="unknown config field 'optim.interval_s'"):
        resolve_config({"optim": {"interval_s": 5}}, {}, {})
    with pytest.raises(ConfigError, match="section 'optim' must be a mapping of its fields, got 3"):
        resolve_config({"optim": 3}, {}, {})


def test_a_flag_overrides_an_invalid_env_value():
    """The flag wins, so the env var it overrides is never read; without the flag it is still an error."""
    env = {"DFLASH_PROFILE_INTERVAL": "abc", "DFLASH_SPLIT_FC_LAYERS": "maybe"}
    cfg = resolve_config({}, env, {"profile_interval": "5", "split_fc_layers": False})
    assert cfg.profile.interval_s == 5.0 and cfg.parallel.split_fc_layers is False
    with pytest.raises(ConfigError, match="env DFLASH_PROFILE_INTERVAL"):
        resolve_config({}, {"DFLASH_PROFILE_INTERVAL": "abc"}, {})


def test_every_field_has_a_docstring_and_help_is_grouped_by_section():
    import dataclasses

    for cls in (TrainConfig, *SECTIONS.values()):
        docs = field_docs(cls)
        assert {f.name for f in dataclasses.fields(cls)} == set(docs), cls
        assert all(len(d) > 10 for d in docs.values())
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in build_parser()._action_groups}
    assert set(SECTIONS) <= set(groups)
    assert "--profile-interval" in groups["profile"] and "--lr" in groups["optim"] and "--data" in groups["data"]


@pytest.mark.parametrize("file,env,flags,needle", [
    ({"max_stepz": 3}, {}, {}, "unknown config field 'max_stepz'"),
    ({}, {}, {"max_steps": "0"}, "config field 'optim.max_steps': must be >= 1"),
    ({}, {}, {"max_steps": "ten"}, "--max-steps: field 'optim.max_steps' expects int"),
    ({}, {"DFLASH_PROFILE_INTERVAL": "soon"}, {}, "env DFLASH_PROFILE_INTERVAL: field 'profile.interval_s'"),
    ({}, {"DFLASH_SPLIT_FC_LAYERS": "maybe"}, {}, "env DFLASH_SPLIT_FC_LAYERS: field 'parallel.split_fc_layers'"),
    ({}, {}, {"transfer": "carrier-pigeon"}, "config field 'parallel.transfer': must be auto, nccl or host"),
    ({}, {}, {"data": "/nonexistent.jsonl"}, "config field 'data.path': no such file"),
    ({"lr": True}, {}, {}, "field 'optim.lr' expects float"),
    ({}, {}, {"profile_interval": "inf"}, "config field 'profile.interval_s': must be a finite number (got inf)"),
    ({"lr": "nan"}, {}, {}, "config field 'optim.lr': must be a finite number"),
    ({}, {}, {"gamma": "-inf"}, "config field 'optim.gamma': must be a finite number"),
    ({}, {}, {"hidden_noise": "1e999"}, "config field 'optim.hidden_noise': must be a finite number"),
    ({}, {}, {"rendezvous_timeout_s": "0"}, "config field 'parallel.rendezvous_timeout_s': must be > 0"),
])
def test_bad_values_name_the_field(file, env, flags, needle):
    with pytest.raises(ConfigError) as e:
        resolve_config(file, env, flags)
    assert needle in str(e.value)


def test_the_sectioned_dict_round_trips_and_the_flat_one_is_keyed_by_flag():
    cfg = resolve_config({"model": {"block_size": 8}}, {}, {"profile": False})
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and cfg.to_dict()["model"]["block_size"] == 8
    assert cfg.flat_dict()["profile"] is False and cfg.flat_dict()["block_size"] == 8
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_steps: 3\nblock_sise: 8\n")
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dflash-train: error: {cfg}:2: unknown config field 'block_sise'"]
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    assert main(["--config", str(bad)]) == 2
    assert f"{bad}:1:2: not valid JSON" in capsys.readouterr().err
    assert main(["--resume"]) == 2
    assert "--resume: needs --run-dir" in capsys.readouterr().err


def test_console_script_exit_code_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--num-anchors", "-3"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "dflash-train: error: config field 'optim.num_anchors': must be >= 1 (got -3)"
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("name,text,line", [
    ("syntax.yaml", "optim:\n  lr: 0.01\n  max_steps: [1, 2\nprofile:\n  interval_s: 5\n",
     "syntax.yaml:4:8: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence that began "
     "at line 3)"),
    ("tab.yaml", "optim:\n\tlr: 0.01\n", "tab.yaml:2:1: not valid YAML: found character '\\t' that cannot start any token"),
    ("unknown.yaml", "optim:\n  lr: 0.01\n  max_stepz: 3\n", "unknown.yaml:3: unknown config field 'optim.max_stepz'"),
    ("type.yaml", "seed: 1\nmax_steps: ten\n", "type.yaml:2: field 'optim.max_steps' expects int, got 'ten'"),
    ("twice.yaml", "lr: 0.1\noptim:\n  lr: 0.2\n", "twice.yaml:3: config field 'optim.lr' given twice"),
    ("section.yaml", "\noptim: 3\n", "section.yaml:2: section 'optim' must be a mapping of its fields, got 3"),
    ("syntax.json", '{\n  "optim": {\n    "lr": 0.01,\n  }\n}\n',
     "syntax.json:4:3: not valid JSON: Expecting property name enclosed in double quotes"),
    ("type.json", '{\n  "optim": {\n    "lr": 0.01,\n    "max_steps": "ten"\n  }\n}\n',
     "type.json:4: field 'optim.max_steps' expects int, got 'ten'"),
    ("list.json", "[1]", "list.json:1: top level must be a mapping of config sections or fields"),
])
def test_a_config_file_error_names_its_file_and_line(tmp_path, name, text, line):
    """Syntax errors at the parser's line and column; an unknown key or a wrong type at its key's line (the YAML
    parser's marks, which read JSON files too)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        config_from_args(build_parser().parse_args(["--config", str(path)]), env={})
    assert str(e.value) == f"{tmp_path}/{line}"


def test_a_yaml_error_in_a_real_launch_is_one_line_with_its_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.01\n  warmup_steps: {10\n")
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--config", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"dflash-train: error: {path}:4:1: not valid YAML: ") and len(r.stderr.splitlines()) == 1


def test_help_shows_every_default(capsys):
    """Each flag's help ends with its default, as a command line would spell it."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert all("(default: " in (a.help or "") for a in flags), [a.dest for a in flags if "(default: " not in a.help]
    for needle in ("(default: 150)", "(default: 0.003)", "(default: auto)", "(default: on)", "(default: off)",
                   "[data.builtin_cache]", "--no-cache", "(default: 25)", "--stop-timeout-s"):
        assert needle in text, needle


def test_every_dflash_variable_lands_in_the_config():
    env = {"DFLASH_FUSED_ELEMENTWISE": "0", "DFLASH_FUSED_CE": "off", "DFLASH_FAULT": "crash@target.fwd:step=2"}
    cfg = resolve_config({}, env, {})
    assert (cfg.model.fused_elementwise, cfg.model.fused_ce) == (False, False)
    assert cfg.reliability.fault == "crash@target.fwd:step=2"
    assert resolve_config({}, {}, {}).to_dict()["model"]["fused_ce"] is True


@pytest.mark.parametrize("fault, args, why", [
    ("crash@h2d_copy", [], "a CPU run has no host-device copies"),
    ("slow=1@d2h_copy:step=2", [], "a CPU run has no host-device copies"),
    ("crash@drafter.allreduce", [], "one drafter rank has nothing to all-reduce"),
    ("hang@eval.decode", ["--eval-prompts", "0"], "--eval-prompts 0"),
])
def test_a_fault_this_run_can_never_fire_is_refused_before_any_rank(tmp_path, train_main, fault, args, why):
    """Issue 34 row 8: a fault on a span this run's topology never enters would be accepted and never fire."""
    r = train_main(["--device", "cpu", "--run-dir", tmp_path / "run", *args], env={"DFLASH_FAULT": fault})
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if "DFLASH_FAULT" in ln]
    assert f"this run never enters {fault.split('@')[1].split(':')[0]} ({why})" in line
    assert not (tmp_path / "run").exists()


def test_a_metrics_port_that_leaves_no_room_for_every_local_rank_is_one_line(tmp_path, train_main):
    """Issue 34 row 11: --metrics-port 65535 with two local ranks was an OverflowError traceback."""
    r = train_main(["--device", "cpu", "--run-dir", tmp_path / "run", "--metrics-port", "65535"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--metrics-port 65535: local rank 1 would serve on port 65536 (base + local rank), past 65535" in r.stderr


def test_a_prometheus_sd_dir_that_is_a_file_or_a_symlink_is_one_line_before_the_run(tmp_path, train_main):
    """A --prometheus-sd-dir given that is a file or a symlink was only a warning once the ranks had started."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path)
    for name, why in (("file", "is not a directory"), ("link", "is a symlink")):
        r = train_main(["--device", "cpu", "--run-dir", tmp_path / f"run-{name}", "--prometheus-sd-dir",
                        tmp_path / name])
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"--prometheus-sd-dir {tmp_path / name}: {why}; " in r.stderr, r.stderr
        assert not (tmp_path / f"run-{name}").exists()   # refused before anything is written


def test_resume_of_a_run_that_died_before_its_first_checkpoint_starts_it_again(tmp_path, capsys):
    """Issue 34 row 15: such a directory refused a fresh run ("already holds a run") and --resume ("no
    checkpoint"): a dead end. --resume now starts it from step 0 and says so; a directory with no run at all
    is still refused, saying what to do."""
    from dflash import preflight, worker
    from dflash.config import TrainConfig

    run = tmp_path / "died"
    (run / "profile").mkdir(parents=True)
    (run / "profile" / "rank0.jsonl").write_text('{"type": "run_start"}\n')
    (run / "checkpoints").mkdir()
    cfg = TrainConfig()
    cfg.run_dir, cfg.reliability.resume = str(run), True
    preflight._check_run_dir(cfg)                     # accepted
    assert worker._resume_state(cfg, run, rank=0) is None
    assert "has no checkpoint (its run ended before the first one): starting from step 0" in capsys.readouterr().err
    cfg.run_dir = str(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"--resume: no run in .*drop --resume to start one there"):
        preflight._check_run_dir(cfg)


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(tmp_path, train_main):
    """Issue 34 row 4: two runs on one --run-dir interleaved their logs and wrote each checkpoint twice.
    The run's lock is held (here by this test process); a second dflash-train gets one line naming the
    holder's pid, exit 2, nothing written; once the holder is gone, its lock is taken over."""
    import os

    from dflash.run_lock import hold_run_dir

    run = tmp_path / "run"
    fd = hold_run_dir(run)
    before = sorted(p.name for p in run.iterdir())
    r = train_main(["--device", "cpu", "--run-dir", run, "--max-steps", "2"])
    assert r.returncode == 2, r.stderr
    assert f"in use by another dflash-train (pid {os.getpid()}, which holds {run / '.lock'})" in r.stderr
    assert sorted(p.name for p in run.iterdir()) == before
    os.close(fd)                       # the holder ends: its lock goes with it
    os.close(hold_run_dir(run))        # and is taken over


def test_the_trainer_takes_tick_s_from_its_flag_and_env():
    assert resolve_config({}, {}, {}).profile.tick_s == 5.0
    assert resolve_config({}, {"DFLASH_PROFILE_TICK_S": "2"}, {}).profile.tick_s == 2.0
    assert resolve_config({}, {"DFLASH_PROFILE_TICK_S": "2"}, {"profile_tick_s": "1.5"}).profile.tick_s == 1.5
    with pytest.raises(ConfigError, match="'profile.tick_s': must be > 0"):
        resolve_config({}, {}, {"profile_tick_s": "0"})
