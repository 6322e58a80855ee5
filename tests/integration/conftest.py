"""Fixtures of the end-to-end tests: a live dflash-train run that the test inspects while it runs."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.control import clean_stale_discovery, default_discovery_dir

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _live_run(run: Path, args: list, env: dict):
    out = open(run.parent / "train.log", "w")
    train = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *args], cwd=REPO,
                             stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, **env), start_new_session=True)
    try:
        yield train
    finally:
        try:
            os.killpg(train.pid, signal.SIGKILL)  # its own session: the launcher and its ranks
        except ProcessLookupError:
            pass  # it ended on its own (the test's assertion says why)
        train.wait()
        out.close()
        time.sleep(0.5)
        clean_stale_discovery(default_discovery_dir())  # the killed ranks could not remove theirs


@pytest.fixture(scope="session")
def live_run():
    """live_run(run_dir, args, env) -> a context manager around a real `dflash-train --run-dir RUN_DIR ARGS`
    with `env` added, output in RUN_DIR/../train.log, in its own session: on exit it is killed with its
    ranks and their discovery files are removed."""
    return _live_run
