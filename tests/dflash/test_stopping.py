"""dflash.stopping: the stop flag's deadline and the resume command a stopped run prints (real processes:
tests/integration/test_stops.py)."""

from __future__ import annotations

import shlex
import signal
import time
from pathlib import Path

from dflash.cli import build_parser
from dflash.config import TrainConfig, config_from_args, resolve_config
from dflash.stopping import StopFlag, resume_command, stop_line


def test_the_resume_command_is_the_default_one_for_a_default_run():
    assert resume_command(TrainConfig(), Path("/runs/a b")) == "dflash-train --resume --run-dir '/runs/a b'"


def test_the_resume_command_gives_back_every_setting_that_is_not_a_default_except_faults():
    cfg = resolve_config({"optim": {"lr": 0.01}}, {"DFLASH_PROFILE_INTERVAL": "5", "DFLASH_FAULT": "slow=1@drafter.optim"},
                         {"max_steps": "40", "profile": False, "split_fc_layers": True, "run_dir": "r"})
    words = shlex.split(resume_command(cfg, Path("r")))
    assert words[:4] == ["dflash-train", "--resume", "--run-dir", "r"]
    assert "--fault" not in words and "--no-profile" in words and "--split-fc-layers" in words
    again = config_from_args(build_parser().parse_args(words[1:]), env={})
    cfg.reliability.fault, cfg.reliability.resume = "", True
    assert again == cfg   # the command, parsed, is this run's config


def test_the_stop_line_names_the_step_the_checkpoint_and_the_command():
    line = stop_line("SIGTERM", 37, Path("/r/checkpoints/step_0000037"), TrainConfig(), Path("/r"))
    assert line == ("dflash-train: stopped by SIGTERM at step 37 (evaluation skipped); checkpoint "
                    "/r/checkpoints/step_0000037; resume with: dflash-train --resume --run-dir /r")


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
