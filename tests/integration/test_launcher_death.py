"""Issue 34 row 5: `kill -9` of the launcher left both ranks re-parented to pid 1, training on for 105 s with
the ports and the directory held. Each rank now asks the kernel for SIGTERM when its launcher dies, stops at
a step boundary and writes its run_end."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.schema.records import read_records

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024",
         "--max-length", "128", "--profile-interval", "1", "--device", "cpu"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie (reaped later by init) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_the_ranks_end_within_seconds_of_their_launchers_sigkill(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    launcher = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--max-steps", "10000",
                                 *SMALL], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    pids, deadline = {}, time.monotonic() + 240
    try:
        while len(pids) < 2 and time.monotonic() < deadline:   # both ranks past their first interval
            for rank in (0, 1):
                log = run / "profile" / f"rank{rank}.jsonl"
                recs = read_records(log)[0] if log.is_file() else []
                if any(r["type"] == "interval" for r in recs):
                    pids[rank] = next(r["pid"] for r in recs if r["type"] == "run_start")
            time.sleep(0.5)
        assert len(pids) == 2, "the run did not get under way"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        while any(_alive(p) for p in pids.values()) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        gone_s = time.monotonic() - t0
        assert not any(_alive(p) for p in pids.values()), f"ranks still alive {gone_s:.0f} s after the launcher"
        assert gone_s < 30
        for rank in (0, 1):
            assert any(r["type"] == "run_end" for r in read_records(run / "profile" / f"rank{rank}.jsonl")[0])
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
