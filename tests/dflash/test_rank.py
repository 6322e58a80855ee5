"""The rank's import wrapper: no collection runs inside, what it made is frozen, the collector's state
comes back as it was."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from dflash.handoff import long_lived


def test_long_lived_pauses_then_freezes_and_restores():
    passes, kept = [], []
    gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
    try:
        for enabled_before in (True, False):
            (gc.enable if enabled_before else gc.disable)()
            gc.unfreeze()       # earlier tests' frozen objects that die meanwhile would leave the count
            frozen0 = gc.get_freeze_count()
            passes.clear()
            with long_lived():
                made = [[i] for i in range(50_000)]          # far past the young generation's threshold
                kept.append(made)                            # alive: frozen ones that die leave the count
                assert not gc.isenabled()
            assert passes == []                              # no pass ran over them meanwhile
            assert gc.get_freeze_count() >= frozen0 + len(made)
            assert gc.isenabled() is enabled_before
    finally:
        gc.callbacks.pop()
        gc.unfreeze()
        gc.enable()


def test_a_rank_started_by_hand_without_its_gate_says_so_in_one_line():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DFLASH_GATE_FD"}
    procs = [subprocess.Popen([sys.executable, "-m", "dflash.rank"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env if gate is None else dict(env, DFLASH_GATE_FD=gate))
             for gate in (None, "99")]      # unset; not an open descriptor. Side by side: each imports torch
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
        assert err.startswith("dflash-train: error: a rank process reads its config from the launcher's gate")


def test_gated_ranks_start_with_the_bytecode_cache_in_their_environment(tmp_path, monkeypatch):
    from dflash.launch import GatedRanks

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    ranks = GatedRanks(1, time.time_ns(), {"PYTHONPYCACHEPREFIX": str(tmp_path), "PYTHONDONTWRITEBYTECODE": None})
    proc = Path(f"/proc/{ranks.procs[0].pid}")
    try:
        deadline = time.monotonic() + 10
        while b"dflash.rank" not in (proc / "cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)   # environ is the parent's until the child has exec'd
        raw = (proc / "environ").read_bytes().decode()
    finally:
        ranks.abort()
    env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path) and "PYTHONDONTWRITEBYTECODE" not in env
