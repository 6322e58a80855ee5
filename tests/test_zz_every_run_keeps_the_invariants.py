"""`dflash-report check` on every real run this session made (DESIGN.md: "every test that makes a real run
calls it"). It runs last (the file sorts after the test packages) and finds the runs under pytest's session
directory, where each test's and fixture's runs still are: directories dflash-train wrote (their config.json
holds the resolved topology), not the logs tests craft. A test that damages a run on purpose (a truncated
log) leaves a `.check-skip` file saying why."""
from pathlib import Path

import pytest

from profiler.report.check import check_run

SKIP_MARK = ".check-skip"


def _run_dirs(base: Path) -> list:
    dirs = {p.parent.parent for p in base.rglob("profile/rank*.jsonl")}
    return sorted(d for d in dirs if '"resolved"' in _read(d / "config.json"))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_every_run_the_session_made_keeps_the_invariants(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    runs = [d for d in _run_dirs(base) if not (d / SKIP_MARK).exists()]
    if not runs:
        pytest.skip("this session made no real run")
    broken = {str(d.relative_to(base)): [f"{v.invariant}: {v.where}: {v.message}" for v in found]
              for d in runs if (found := check_run(d))}
    assert not broken, "\n".join(f"{d}:\n  " + "\n  ".join(v) for d, v in broken.items())
