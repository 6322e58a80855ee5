"""What the CLIs print goes through here: control characters escaped (a thread name or a log field cannot
drive the terminal) and a closed pipe (`dflash-report ... | head`) ends the command quietly."""
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


@contextlib.contextmanager
def cli_output():
    """sys.stdout and sys.stderr escaped while the command runs; a BrokenPipeError exits 0 without a
    traceback (stdout pointed at /dev/null, so the interpreter's final flush cannot raise again)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapingStream(out), EscapingStream(err)
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        raise SystemExit(0) from None
    finally:
        sys.stdout, sys.stderr = out, err
