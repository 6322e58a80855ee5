"""Issue 37 item 5: discovery that cannot collide. Two real runs whose directories have the same name, at once:
each lists its ranks in the one shared file_sd directory under its own unique `run` label (the run id of its
run_start and config.json) with the directory's name as `run_dir`; nothing is made beside either run; a --resume
keeps the run's id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.schema.records import read_records
from tests.conftest import free_port_pair

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128",
         "--profile-interval", "1", "--device", "cpu"]


def run_starts(run: Path) -> list:
    return [r for r in read_records(run / "profile" / "rank0.jsonl")[0] if r["type"] == "run_start"]


def test_two_runs_of_the_same_name_get_their_own_run_label_in_one_place_and_a_resume_keeps_it(tmp_path, prebuilt):
    sd = Path(os.environ["XDG_CACHE_HOME"]) / "dflash" / "prometheus-sd"   # the session's (tests/conftest.py)
    runs = {side: prebuilt(tmp_path / side / "run") for side in ("a", "b")}
    ports = {side: free_port_pair() for side in runs}
    procs = {side: subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--max-steps",
                                     "100000", "--metrics-port", str(ports[side]), *SMALL], cwd=REPO,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for side, run in runs.items()}
    try:
        deadline, groups = time.monotonic() + 240, {}
        while len(groups) < 2 and time.monotonic() < deadline:
            for side, run in runs.items():
                ids = [json.loads((run / "config.json").read_text()).get("run_id")] if (run / "config.json").is_file() \
                    else []
                if ids and (sd / f"{ids[0]}.json").is_file():
                    groups[side] = (ids[0], json.loads((sd / f"{ids[0]}.json").read_text()))
            time.sleep(0.3)
        assert len(groups) == 2, "the runs did not list their ranks"
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        errs = {side: p.communicate(timeout=120)[1] for side, p in procs.items()}
    assert [p.returncode for p in procs.values()] == [0, 0], errs
    (id_a, [group_a]), (id_b, [group_b]) = groups["a"], groups["b"]
    assert id_a != id_b and id_a.startswith("run-") and id_b.startswith("run-")
    assert group_a["labels"] == {"run": id_a, "run_dir": "run"} and group_b["labels"] == {"run": id_b, "run_dir": "run"}
    assert group_a["targets"] == [f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['a'] + 1}"]
    assert [s["run_id"] for s in run_starts(runs["a"])] == [id_a]
    assert not (sd / f"{id_a}.json").exists() and not (sd / f"{id_b}.json").exists()   # withdrawn at the end
    assert not list(tmp_path.rglob("prometheus-sd"))   # nothing beside the runs (their own prometheus/ only)

    step = int((runs["a"] / "checkpoints" / "latest").read_text().strip().split("_")[1])
    again = subprocess.run([sys.executable, "-m", "dflash.cli", "--resume", "--run-dir", str(runs["a"]), "--max-steps",
                            str(step + 1), "--metrics-port", "0", *SMALL], cwd=REPO, capture_output=True, text=True,
                           timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [s["run_id"] for s in run_starts(runs["a"])] == [id_a, id_a]
    assert json.loads((runs["a"] / "config.json").read_text())["run_id"] == id_a
