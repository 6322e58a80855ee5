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


def test_a_second_signal_within_a_second_of_the_first_does_not_escalate_but_a_later_one_does():
    """Issue 46: two SIGINTs 0.1-0.3 s apart (one Ctrl-C reaching the launcher twice, a double press) set the
    ranks' SIGKILL 3 s later, cutting a clean stop short; the docs say a second signal within 1 s does not count,
    as the ranks themselves have it (profiler.watchdog.SignalWatch)."""
    rank = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
                             "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "ready\n"
        now = [100.0]
        sup = Supervisor([rank], grace_s=3.0, clock=lambda: now[0])
        sup.forward(signal.SIGINT)
        now[0] += 0.3
        sup.forward(signal.SIGINT)
        assert sup.kill_at_s is None             # the clean stop goes on
        now[0] += 0.8
        sup.forward(signal.SIGINT)               # 1.1 s after the first: escalates
        assert sup.kill_at_s == 104.1
    finally:
        rank.kill()
        rank.wait()
