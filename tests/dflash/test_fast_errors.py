"""A mistake that needs no torch is answered without importing it: one line, exit 2, before any rank starts.

Each case runs `dflash-train` as a user does, in a fresh interpreter, and asserts torch was never imported
(what makes such an error take seconds, 5-12 s on a loaded machine); the time each took is printed, and the
figures on an idle and a loaded VM are in bench/RESULTS.md. Importing torch, not the clock, is what is asserted:
a busy machine cannot make this test fail or pass.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Runs dflash-train's main in this interpreter, then says whether torch was imported on the way.
PROBE = ("import sys\nfrom dflash import cli\ntry:\n    code = cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
         "    code = e.code\nprint('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
         "sys.exit(code)\n")


def run_cli(args: list, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                            "HOME": str(cwd), "XDG_CACHE_HOME": str(cwd / "cache")})
    return done, time.perf_counter() - started


def cases(tmp: Path) -> dict:
    """{name: argv} of mistakes a user makes, each with the directory state it needs."""
    (tmp / "held" / "profile").mkdir(parents=True)
    (tmp / "held" / "profile" / "rank0.jsonl").write_text("{}\n")
    (tmp / "empty").mkdir()
    (tmp / "a-file").write_text("x")
    return {"resume without a run dir": ["--resume"],
            "resume of an empty directory": ["--resume", "--run-dir", str(tmp / "empty")],
            "resume of a directory that does not exist": ["--resume", "--run-dir", str(tmp / "nowhere")],
            "a run dir that already holds a run": ["--run-dir", str(tmp / "held")],
            "a run dir that is a file": ["--run-dir", str(tmp / "a-file")],
            "a prometheus-sd-dir that is a file": ["--prometheus-sd-dir", str(tmp / "a-file")],
            "a mistyped flag": ["--profile-interv", "60"],
            "a negative step count": ["--max-steps", "-3"],
            "a config file that does not exist": ["--config", str(tmp / "missing.yaml")],
            "a memory plan on the CPU": ["--plan-memory", "--device", "cpu"],
            "a memory plan resumed": ["--plan-memory", "--resume", "--run-dir", str(tmp / "held")]}


NAMES = ["resume without a run dir", "resume of an empty directory", "resume of a directory that does not exist",
         "a run dir that already holds a run", "a run dir that is a file", "a prometheus-sd-dir that is a file",
         "a mistyped flag", "a negative step count", "a config file that does not exist", "a memory plan on the CPU",
         "a memory plan resumed"]


@pytest.mark.parametrize("name", NAMES)
def test_a_mistake_needing_no_torch_is_one_line_and_exit_2_without_importing_torch(name, tmp_path):
    made = cases(tmp_path)
    assert list(made) == NAMES
    args = made[name]
    done, took_s = run_cli(args, tmp_path)
    print(f"{name}: {took_s:.2f} s")
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1] == "no torch", f"{name}: torch was imported before the error ({took_s:.1f} s)"
    lines = lines[:-1]
    assert len(lines) == 1 and lines[0].startswith("dflash-train: error: "), done.stderr
    assert not list(tmp_path.glob("runs")), "nothing was created"
