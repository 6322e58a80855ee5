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
    ({}, {}, {"capture_every": "3"},
     "config field 'profile.capture_every': needs --capture-at-step (the first capture) (got 3)"),
    ({}, {}, {"capture_at_step": "1", "capture_every": "2", "capture_steps": "2"},
     "config field 'profile.capture_every': must be more than capture_steps (2): captures do not overlap (got 2)"),
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


# ------------------------------------------------------------------------------------------- issue 46
def saved_run(tmp_path, flags: dict, name: str = "run"):
    """A run directory as a run leaves it: profile/ and the config.json rank 0 writes (settings, id, history)."""
    run = tmp_path / name
    (run / "profile").mkdir(parents=True)
    cfg = resolve_config({}, {}, dict(flags, run_dir=str(run)))
    (run / "config.json").write_text(json.dumps(dict(cfg.to_dict(), run_id="run-1", overrides=[])))
    return run, cfg


def resumed(run, *flags, env=None):
    return config_from_args(build_parser().parse_args(["--resume", "--run-dir", str(run), *flags]), env=env or {})


def test_a_resume_restores_the_runs_settings_and_a_flag_overrides_only_its_own(tmp_path):
    """Issue 46: `--resume --run-dir D --max-steps N` built the default settings (num_anchors 8, max_length 256,
    tokens_per_batch 2048) over a run made with others, silently."""
    run, cfg = saved_run(tmp_path, {"num_anchors": "16", "max_length": "128", "tokens_per_batch": "1024",
                                    "max_steps": "3", "lr": "0.01", "profile_interval": "2"})
    again = resumed(run, "--max-steps", "9", "--profile-interval", "5")
    assert (again.optim.num_anchors, again.data.max_length, again.data.tokens_per_batch, again.optim.lr) == (
        16, 128, 1024, 0.01)
    assert (again.optim.max_steps, again.profile.interval_s, again.reliability.resume) == (9, 5.0, True)
    env = resumed(run, env={"DFLASH_PROFILE_INTERVAL": "7"})   # file < env < flags, over the run's own
    assert env.profile.interval_s == 7.0 and env.optim.max_steps == 3


@pytest.mark.parametrize("flags, field", [
    (["--block-size", "8"], "model.block_size"), (["--num-anchors", "32"], "optim.num_anchors"),
    (["--seed", "1"], "optim.seed"), (["--max-length", "64"], "data.max_length"),
    (["--num-draft-layers", "3"], "model.num_draft_layers")])
def test_a_change_the_checkpoint_cannot_take_is_one_line_exit_2_before_any_rank(tmp_path, flags, field, capsys,
                                                                              monkeypatch):
    run, _ = saved_run(tmp_path, {"num_anchors": "16", "max_length": "128", "tokens_per_batch": "1024"})
    before = (run / "config.json").read_bytes()
    from dflash import launch

    monkeypatch.setattr(launch, "GatedRanks", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--resume", "--run-dir", str(run), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash-train: error: --resume: config field '{field}' cannot "
                                               "change from "), err
    assert (run / "config.json").read_bytes() == before
    resumed(run, "--num-anchors", "16", "--block-size", "16")   # the run's own values repeated: accepted


def test_a_target_and_data_given_relative_or_absolute_are_the_same_on_resume(tmp_path, monkeypatch):
    target, data = tmp_path / "target", tmp_path / "train.jsonl"
    target.mkdir()
    data.write_text("{}\n")
    run, _ = saved_run(tmp_path, {"target_model": str(target), "data": str(data)})
    monkeypatch.chdir(tmp_path)
    again = resumed(run, "--target-model", "target", "--data", "train.jsonl")
    assert again.model.target_model == "target"
    assert resumed(run).model.target_model == str(target)   # not repeated: restored
    with pytest.raises(ConfigError, match=r"config field 'data.eval_prompts' cannot change from 8 to 2"):
        resumed(run, "--eval-prompts", "2")   # the held-out prompts come out of --data: its records change


def test_a_resume_whose_run_lost_its_config_json_is_refused_and_one_with_no_run_left_to_preflight(tmp_path):
    run, _ = saved_run(tmp_path, {})
    (run / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config.json: missing, so the run's settings cannot be restored"):
        resumed(run)
    (run / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json: unreadable, so the run's settings cannot be restored"):
        resumed(run)
    assert resumed(tmp_path / "nothing-here").reliability.resume   # the preflight refuses it, in its words


def test_the_override_history_keeps_every_resumes_changes():
    from dflash.config import override_history

    first = resolve_config({}, {}, {"max_steps": "3", "run_dir": "r"})
    saved = dict(first.to_dict(), overrides=[{"at": "T0", "changed": {"lr": {"from": 0.003, "to": 0.01}}}])
    now = resolve_config({}, {}, {"max_steps": "9", "run_dir": "r", "resume": True, "fault": "x@y"}).flat_dict()
    assert override_history(saved, now, "T1") == [
        {"at": "T0", "changed": {"lr": {"from": 0.003, "to": 0.01}}},
        {"at": "T1", "changed": {"max_steps": {"from": 3, "to": 9}}}]   # resume and faults are no settings
    assert override_history(saved, first.flat_dict(), "T2") == saved["overrides"]   # nothing changed: nothing added
    assert override_history(None, now, "T3") == []


@pytest.mark.parametrize("flag, field, bound", [
    ("--stop-timeout-s", "reliability.stop_timeout_s", "3600"),
    ("--rendezvous-timeout-s", "parallel.rendezvous_timeout_s", "86400"),
    ("--hang-timeout-s", "reliability.hang_timeout_s", "604800"),
    ("--profile-interval", "profile.interval_s", "86400")])
def test_every_timeout_is_bounded_and_a_huge_one_is_refused_naming_the_field(flag, field, bound):
    """Issue 46: --stop-timeout-s 1e308 was accepted and a SIGTERM then crashed both ranks (OverflowError:
    timestamp out of range); --rendezvous-timeout-s 1e308, two tracebacks (C int overflow). A ConfigError is one
    line and exit 2 (test_cli_bad_input_exits_2_with_one_line)."""
    with pytest.raises(ConfigError) as e:
        config_from_args(build_parser().parse_args([flag, "1e308"]), env={})
    assert str(e.value) == f"config field '{field}': must be <= {bound} (got 1e+308)"
    config_from_args(build_parser().parse_args([flag, bound]), env={})   # the bound itself is accepted


@pytest.mark.parametrize("host, shown", [("127.0.0.\udcff", r"'127.0.0.\udcff'"),
                                         ("\x1b]0;owned\x07\x1b[2J", r"'\x1b]0;owned\x07\x1b[2J'")])
def test_a_metrics_host_with_an_undecodable_byte_or_an_escape_is_refused_escaped(tmp_path, host, shown, capfd,
                                                                                  monkeypatch):
    """Issue 46: a non-UTF-8 byte in --metrics-host was a TypeError traceback (encoding of hostname failed); a
    config file's metrics_host holding escape sequences reached stderr raw (window title, clear screen)."""
    monkeypatch.delenv("RANK", raising=False)
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"metrics_host": host}, ensure_ascii=True))
    for args in (["--metrics-host", host], ["--config", str(conf)]):
        assert main(["--device", "cpu", "--run-dir", str(tmp_path / "run"), *args]) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "\x1b" not in err and "Traceback" not in err, err
        assert f"config field 'telemetry.metrics_host': must be an address (no control or undecodable bytes) " \
               f"(got {shown})" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("make", [lambda t: t / ("x" * 256) / "run", lambda t: t / "/".join(["y" * 200] * 21)])
def test_a_run_dir_too_long_for_the_system_is_one_line_exit_2(tmp_path, make, capfd, monkeypatch):
    """Issue 46: a 256-byte --run-dir component, or a path over PATH_MAX: an ENAMETOOLONG traceback from the
    preflight, exit 1."""
    monkeypatch.delenv("RANK", raising=False)
    run = make(tmp_path)
    for resume in ([], ["--resume"]):
        assert main(["--device", "cpu", "--run-dir", str(run), *resume]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "over the system's limit" in err[0] and "Traceback" not in err[0], err


def test_a_lock_symlink_planted_in_a_shared_run_dir_is_one_line_and_its_victim_untouched(tmp_path, capfd,
                                                                                           monkeypatch):
    """Issue 46: the victim stayed untouched (O_NOFOLLOW) but the refusal was an ELOOP traceback, exit 1."""
    monkeypatch.delenv("RANK", raising=False)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "shared"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    assert main(["--device", "cpu", "--run-dir", str(run), "--max-steps", "1"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"dflash-train: error: --run-dir {run}: its lock file {run / '.lock'} is a symlink; not "
                   "followed, nothing written: remove it if it is not yours, or choose another directory"]
    assert victim.read_text() == "precious\n" and sorted(p.name for p in run.iterdir()) == [".lock"]


def test_a_prometheus_sd_dir_through_another_users_symlink_is_refused_before_any_chmod(tmp_path, train_main):
    """Issue 46: with another user's symlink in a middle component of --prometheus-sd-dir, root's 0700 directory
    behind it was made 0755 (only the last component was checked)."""
    import os

    from dflash import telemetry

    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    link = shared / "link"
    link.symlink_to(secret)
    try:
        os.lchown(link, 4242, 4242)   # planted by another user
    except PermissionError:
        pytest.skip("needs root to make a symlink of another user")
    given = link / "sd"
    with pytest.raises(PermissionError, match="is a symlink of uid 4242"):   # the run's own write, a warning
        telemetry.write_shared(given / "run-1.json", "[]\n")
    r = train_main(["--device", "cpu", "--run-dir", tmp_path / "run", "--prometheus-sd-dir", given])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"dflash-train: error: --prometheus-sd-dir {given}: {link} is a symlink of uid 4242, neither yours nor "
        "root's: refused; give a directory reached only through yours or root's"]
    assert (secret.stat().st_mode & 0o777) == 0o700 and not (secret / "sd").exists()
    telemetry.write_shared(tmp_path / "mine" / "sd" / "run-1.json", "[]\n")   # ours all the way: written, 0755
    assert (tmp_path / "mine" / "sd").stat().st_mode & 0o777 == 0o755


def test_a_ranks_profiler_settings_come_from_the_profile_telemetry_and_reliability_sections():
    cfg = resolve_config({}, {}, {"profile_interval": "7", "profile_tick_s": "1.5", "profile_detail_steps": "2",
                                  "memory_history": "9", "nvtx": True, "capture_at_step": "4", "capture_steps": "2",
                                  "capture_every": "10", "export_timeout_s": "3", "hang_timeout_s": "40",
                                  "fault": "nan@target.fwd"})
    got = cfg.profiler_config(detail_follows=True, warmup_steps=5, phase_spans=("ckpt.save",))
    assert (got.interval_s, got.tick_s, got.detail_steps, got.memory_history, got.nvtx) == (7.0, 1.5, 2, 9, True)
    assert (got.capture_at_step, got.capture_steps, got.capture_every) == (4, 2, 10)
    assert (got.export_timeout_s, got.hang_timeout_s, got.faults) == (3.0, 40.0, "nan@target.fwd")
    assert (got.detail_follows, got.warmup_steps, got.phase_spans) == (True, 5, ("ckpt.save",))
