"""What the CLIs print goes through here: control characters escaped (a thread name or a log field cannot
drive the terminal) and a closed pipe (`dflash-report ... | head`) ends the command quietly, with its own status."""
from __future__ import annotations

import contextlib
import os
import sys

from profiler.records import printable


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
