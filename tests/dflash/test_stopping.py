"""dflash.stopping: the stop flag's deadline and the resume command a stopped run prints (real processes:
tests/integration/test_stops.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.cli import build_parser
from dflash.cli_output import ENV_INVOKED_AS, command_for
from dflash.config import config_from_args, resolve_config
from dflash.stopping import StopFlag, resume_command, stop_line


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """dflash-train and dflash-report installed in a bin directory on PATH, and this process run as that
    dflash-train (a rank reads its launcher's argv[0] from ENV_INVOKED_AS)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("dflash-train", "dflash-report"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv(ENV_INVOKED_AS, str(bin_dir / "dflash-train"))
    return bin_dir


def test_the_resume_command_is_the_shortest_one(on_path):
    assert resume_command(Path("/runs/a b")) == "dflash-train --resume --run-dir '/runs/a b'"


def test_printed_commands_are_the_ones_the_user_can_run(on_path, monkeypatch, tmp_path):
    """Issue 51: after the README's set-up nothing is on PATH, and the printed `dflash-train` was not found."""
    assert command_for("dflash-report") == "dflash-report"   # PATH finds the very file beside the one run
    monkeypatch.setenv("PATH", "/usr/bin:/bin")   # the README's .venv/bin/dflash-train, nothing on PATH
    monkeypatch.setenv(ENV_INVOKED_AS, ".venv/bin/dflash-train")
    monkeypatch.chdir(on_path.parent)
    (on_path.parent / ".venv").symlink_to(on_path.parent)   # .venv/bin is the bin directory
    assert command_for("dflash-report") == ".venv/bin/dflash-report"
    assert resume_command(Path("/r")) == ".venv/bin/dflash-train --resume --run-dir /r"
    monkeypatch.setenv(ENV_INVOKED_AS, "/x/dflash/cli.py")   # python -m dflash.cli
    assert command_for("dflash-report") == shlex.join([sys.executable, "-m", "dflash.report_cli"])
    monkeypatch.setenv(ENV_INVOKED_AS, str(tmp_path / "elsewhere" / "dflash-train"))   # gone since: -m
    assert command_for("dflash-train") == shlex.join([sys.executable, "-m", "dflash.cli"])


def test_the_short_resume_command_gives_back_every_setting_of_the_run_except_faults(tmp_path, on_path):
    """Issue 46: the command used to repeat every non-default setting as a flag, and a --resume that did not repeat
    them (the README's form) trained on with the defaults. The run's config.json now restores them all."""
    run = tmp_path / "run"
    cfg = resolve_config({"optim": {"lr": 0.01}}, {"DFLASH_PROFILE_INTERVAL": "5", "DFLASH_FAULT": "slow=1@drafter.optim"},
                         {"max_steps": "40", "profile": False, "split_fc_layers": True, "num_anchors": "16",
                          "run_dir": str(run)})
    (run / "profile").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(dict(cfg.to_dict(), run_dir=str(run), run_id="r-1")))
    words = shlex.split(resume_command(run))
    assert words == ["dflash-train", "--resume", "--run-dir", str(run)]
    again = config_from_args(build_parser().parse_args(words[1:]), env={})
    cfg.reliability.fault, cfg.reliability.resume = "", True
    assert again == cfg   # the command, parsed, is this run's config (its faults left out)


def test_the_stop_line_names_the_step_the_checkpoint_and_the_command(on_path):
    line = stop_line("SIGTERM", 37, Path("/r/checkpoints/step_0000037"), Path("/r"))
    assert line == ("dflash-train: stopped by SIGTERM at step 37 (evaluation skipped); checkpoint "
                    "/r/checkpoints/step_0000037; resume with: dflash-train --resume --run-dir /r")


def test_a_signal_after_the_stop_is_done_cannot_kill_the_exit(tmp_path):
    """Issue 46: two SIGINTs 0.1-0.3 s apart left "rank N was killed by SIGINT" and exit 1 in 2 of 3 runs, though
    every rank had written run_end and the checkpoint: at finalization Python puts SIG_DFL back where it had our
    handler, and the second signal landed then. Here a signal every 10 ms reaches a process whose finalization
    takes 0.3 s; with its stop flag installed and then finished as a rank's is, it must still exit 0."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from dflash.stopping import StopFlag, ignore_further_signals\n"
        "stop = StopFlag(5.0)\n"
        "stop.install()\n"
        "stop.finish()\n"
        "ignore_further_signals()\n"
        "class SlowExit:\n"
        "    def __del__(self):\n"
        "        time.sleep(0.3)\n"
        "slow = SlowExit()\n"
        "subprocess.Popen(['sh', '-c', f'while kill -INT {os.getpid()} 2>/dev/null; do sleep 0.01; done'],\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "time.sleep(0.1)\n")
    p = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    err = p.communicate(timeout=60)[1]   # reaped at once: the signalling loop ends when the pid is gone
    assert p.returncode == 0, (p.returncode, err[-2000:])


def test_the_deadline_fires_once_after_the_first_signal_unless_the_stop_finished():
    fired = []
    flag = StopFlag(0.3, on_expired=lambda name, why: fired.append((name, why)))
    flag.install()
    try:
        assert not flag() and flag.wait(0.05) is False
        flag.note(signal.SIGTERM)
        flag.note(signal.SIGINT)                  # the first is the one kept
        assert flag() and flag.name == "SIGTERM"
        time.sleep(0.6)
        assert fired == [("SIGTERM", "not stopped within --stop-timeout-s 0.3 s")]
        done = StopFlag(0.3, on_expired=lambda name, why: fired.append(name))
        done.install()
        done.note(signal.SIGINT)
        done.finish()
        time.sleep(0.6)
        assert len(fired) == 1
    finally:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
