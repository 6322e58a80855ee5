"""Issue 34 row 14: a rank frozen by SIGSTOP was stopped with the others but never named, and its log ended
without a word. The launcher's supervisor names a rank it has to kill and says why."""
import io
import signal
import subprocess
import sys

from dflash.launch import Supervisor


def test_a_frozen_rank_is_named_with_why_it_had_to_be_killed():
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(1)"])
    frozen.send_signal(signal.SIGSTOP)
    err = io.StringIO()
    try:
        assert Supervisor([frozen, failing], grace_s=0.5, poll_s=0.05, stderr=err).run() == 1
    finally:
        for p in (frozen, failing):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert (f"dflash-train: rank 0 (pid {frozen.pid}) was stopped (SIGSTOP, or a debugger: process state T) and "
            "made no progress: killed, so its log ends without a run_end") in err.getvalue()
    assert "rank 1" not in err.getvalue()   # it said why itself (exit 1)
