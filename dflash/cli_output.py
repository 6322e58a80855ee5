"""What the CLIs print goes through here: control characters escaped (a thread name or a log field cannot
drive the terminal) and a closed pipe (`dflash-report ... | head`) ends the command quietly, with its own status; a training run
(`dflash-train ... | head`) trains on and stops printing instead."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys

from profiler.schema.records import printable


class EscapingStream:
    """A text stream that writes `printable(s)` to the stream it wraps."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, s: str) -> int:
        return self._stream.write(printable(s))

    def __getattr__(self, name):
        return getattr(self._stream, name)


_status = {"code": 0}   # the running command's exit status, as far as it has said it (exit_status)


def exit_status(code: int) -> int:
    """Say the command's exit status before printing its result; returns it. A reader that leaves early
    (`dflash-report check RUN | head`) then ends the command with this status, not 0: a failing check piped into
    head still fails."""
    _status["code"] = code
    return code


@contextlib.contextmanager
def cli_output():
    """sys.stdout and sys.stderr escaped while the command runs; a BrokenPipeError exits without a traceback, with
    the status the command said (exit_status; 0 if it said none), and stdout pointed at /dev/null, so the
    interpreter's final flush cannot raise again."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapingStream(out), EscapingStream(err)
    _status["code"] = 0
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        raise SystemExit(_status["code"]) from None
    finally:
        sys.stdout, sys.stderr = out, err


class QuietOnClosedPipe:
    """A stream that, once its reader has gone (EPIPE: `dflash-train ... | head`), drops what is written instead
    of raising, so a run whose output nobody reads any more trains on to its end. The descriptor is pointed at
    /dev/null then, so the buffered rest and the interpreter's final flush cannot raise either."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False

    def write(self, s: str) -> int:
        if not self.reader_gone:
            try:
                return self._stream.write(s)
            except BrokenPipeError:
                self._gone()
        return len(s)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def whole_lines(stream) -> None:
    """Make a text stream write each line in one write. A run's ranks share the launcher's stderr, and under
    PYTHONUNBUFFERED (dflash.launch sets it) print() writes its text and its newline separately, so two ranks'
    lines interleave ("... stop)dflash-train: error: rank 0: ..." on one line). Line-buffered, each line goes out
    whole, one write of at most PIPE_BUF being atomic on a pipe. A stream that cannot be reconfigured is left."""
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        stream.reconfigure(line_buffering=True, write_through=False)


@contextlib.contextmanager
def quiet_on_closed_pipe():
    """sys.stdout a QuietOnClosedPipe while a training command runs (put back after: tests call it in-process)."""
    out = sys.stdout
    sys.stdout = quiet = QuietOnClosedPipe(out)
    try:
        yield
    finally:
        quiet.flush()   # what is buffered goes now, where a closed pipe is caught, not at the interpreter's exit
        sys.stdout = out


class Parser(argparse.ArgumentParser):
    """argparse for the package's commands: no abbreviated flags (a prefix such as `--profile-interv` is a mistake,
    not a run), and a mistake is one line on stderr, exit 2, naming the closest flag where one is near."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        flags = [tok.split("=", 1)[0] for tok in unknown.group(1).split() if tok.startswith("-")] if unknown else []
        choice = re.match(r"argument .*: invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if flags:
            near = difflib.get_close_matches(flags[0], self._flags(), n=1, cutoff=0.6)
            message = f"unknown flag {flags[0]}" + (f" (did you mean {near[0]}?)" if near else "") + \
                f"; {self.prog} --help lists them"
        elif choice:
            near = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), n=1)
            message += f" (did you mean {near[0]}?)" if near else ""
        self.exit(2, printable(f"{self.prog}: error: {message}").replace("\n", "\\n") + "\n")

    def _flags(self) -> list:
        """Every flag of this parser and of its subcommands' (a flag given before or after the subcommand)."""
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                flags += [f for sub in action.choices.values() for f in sub._option_string_actions]
        return list(dict.fromkeys(flags))


ENV_INVOKED_AS = "DFLASH_INVOKED_AS"   # the launcher's argv[0], for its ranks' printed commands (command_for)
_MODULES = {"dflash-train": "dflash.cli", "dflash-report": "dflash.report_cli", "dflash-profile": "dflash.profile_cli"}


def command_for(prog: str, argv0: str | None = None) -> str:
    """How to run `prog` (dflash-train, dflash-report, dflash-profile) the way the user ran this one: the bare
    name where PATH finds that very file; else the path beside the command they typed (`.venv/bin/dflash-report`
    after `.venv/bin/dflash-train`: the README's set-up puts nothing on PATH); else `PYTHON -m MODULE` (a run
    started with `python -m dflash.cli`). argv0: the command as typed (default: a rank's launcher's, else ours)."""
    import shlex
    import shutil

    argv0 = argv0 or os.environ.get(ENV_INVOKED_AS) or sys.argv[0]
    beside = os.path.join(os.path.dirname(argv0), prog)
    if os.path.basename(argv0) in _MODULES and os.path.isfile(beside):
        on_path = shutil.which(prog)
        if on_path and os.path.realpath(on_path) == os.path.realpath(beside):
            return prog
        return shlex.quote(beside)
    return shlex.join([sys.executable, "-m", _MODULES[prog]])
