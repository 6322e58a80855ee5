"""How a rank stops on SIGTERM or SIGINT: a flag the loops read at each step boundary (the drafter then
checkpoints that step, evaluation is skipped, and the run exits 0), and a deadline that bounds the whole stop,
`--stop-timeout-s` after the first signal, so that a scheduler's grace period (30 s by default under Kubernetes
and Slurm) is not overrun by a step or a checkpoint that takes longer: at the deadline the rank dumps its state
and exits 1, its last checkpoint left as `latest`.
"""

from __future__ import annotations

import shlex
import signal
import threading
import time
from pathlib import Path

from dflash.cli_output import command_for


class StopFlag:
    """Set by SIGTERM/SIGINT (`note`); true for the loops from then on. The handler only stores the signal
    (writing the run log from a signal handler could deadlock on the log's lock) and wakes the deadline's
    thread, which calls `on_expired(signal name, why)` unless `finish()` came first."""

    def __init__(self, timeout_s: float, on_expired=None, clock=time.monotonic):
        self.signum: int | None = None
        self.observed = False
        """True once a loop saw the signal (it is at a step boundary and stopping by itself)."""
        self.timeout_s, self.clock = timeout_s, clock
        self.noted_at_s: float | None = None
        self.on_expired = on_expired or (lambda name, why: None)
        """Called on the deadline's thread when the stop overruns; the worker points it at its forensics."""
        self._signalled, self._finished = threading.Event(), threading.Event()

    def install(self) -> None:
        """Python handlers for SIGTERM and SIGINT, and the deadline's thread (waiting, it costs nothing)."""
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: self.note(signum))
        threading.Thread(target=self._deadline, name="dflash.stop_deadline", daemon=True).start()

    def note(self, signum: int) -> None:
        """Also called by the signal watch's thread, for a main thread blocked where no handler runs."""
        if self.signum is None:  # the first signal is the one recorded (Ctrl-C reaches us twice)
            self.noted_at_s = self.clock()
            self.signum = signum
            self._signalled.set()

    def __call__(self) -> bool:
        self.observed = self.observed or self.signum is not None
        return self.observed

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def wait(self, timeout_s: float) -> bool:
        """Whether a signal came within `timeout_s`."""
        return self._signalled.wait(timeout_s)

    def finish(self) -> None:
        """The rank's stop is done (its run log is closed): the deadline no longer applies."""
        self._finished.set()
        self._signalled.set()   # wakes the deadline's thread, which then ends

    def _deadline(self) -> None:
        self._signalled.wait()
        if self._finished.is_set():
            return
        left_s = self.noted_at_s + self.timeout_s - self.clock()
        if not self._finished.wait(max(0.0, left_s)):
            self.on_expired(self.name, f"not stopped within --stop-timeout-s {self.timeout_s:g} s")


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: `dflash-train --resume --run-dir DIR` (dflash-train as the user ran
    it: cli_output.command_for), nothing more, since a --resume
    restores the run's own settings from DIR/config.json (dflash.config.config_from_args)."""
    return " ".join([command_for("dflash-train"), shlex.join(["--resume", "--run-dir", str(run_dir)])])


def ignore_further_signals() -> None:
    """From the main thread, as a rank's stop is done: SIGINT and SIGTERM ignored from here to the exit. At the
    interpreter's finalization Python puts SIG_DFL back where it had a handler of ours, so a second Ctrl-C or
    forwarded signal landing then killed a rank that had written its run_end and checkpoint ("rank N was
    killed by SIGINT", exit 1); an ignored signal stays ignored. The launcher's SIGKILL still bounds the exit."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def stop_line(signame: str, step: int, checkpoint: Path | None, run_dir: Path) -> str:
    """Rank 0's one line after a stop by a signal: where it stopped, what holds it, how to go on."""
    where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint written"
    return (f"dflash-train: stopped by {signame} at step {step} (evaluation skipped); {where}; "
            f"resume with: {resume_command(run_dir)}")
