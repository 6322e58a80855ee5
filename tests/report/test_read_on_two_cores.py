"""A large run's logs are read on two cores (profiler/report/runs.py SECOND_CORE_MIN_BYTES): a child process reads
about half of them by bytes and sends them back; what the report gets is what one process reads, rank for rank,
and a child's error is the caller's."""
from __future__ import annotations

import json
import os

import pytest

from profiler.report import runs
from profiler.report.runs import ReportError, load_run
from tests.report.test_check import write
from tests.report.ticked import ticked_run


_READ = runs._rank_logs


def _read_saying_where(logs, *args):
    """runs._rank_logs, each RankLog marked with the process that read it (module level: a child started by
    forkserver or spawn, where the test process runs threads, imports it by name)."""
    out = _READ(logs, *args)
    for log in out.values():
        log.read_in_pid = os.getpid()
    return out


@pytest.fixture
def two_cores(monkeypatch):
    """Every run counts as large, on a machine of two cores; each RankLog says which process read it."""
    monkeypatch.setattr(runs, "SECOND_CORE_MIN_BYTES", 0)
    monkeypatch.setattr(runs, "cores", lambda: 2)
    monkeypatch.setattr(runs, "_rank_logs", _read_saying_where)


def _records(run) -> dict:
    return {rank: (log.role, log.run_starts, log.intervals, log.ticks, log.events, log.run_ends, log.bad_lines)
            for rank, log in run.ranks.items()}


def test_two_cores_read_what_one_reads_rank_for_rank(tmp_path, two_cores):
    d = write(tmp_path / "run", ticked_run())
    both = load_run(d)
    alone = load_run(d, second_core=False)
    assert list(both.ranks) == list(alone.ranks) == [0, 1]
    assert _records(both) == _records(alone)
    assert {log.read_in_pid for log in both.ranks.values()} == {os.getpid(), _child_pid(both)}


def _child_pid(run) -> int:
    (pid,) = {log.read_in_pid for log in run.ranks.values()} - {os.getpid()}
    return pid


def test_a_childs_error_is_the_callers(tmp_path, two_cores):
    """A rank log whose schema is newer than this reader, read by the child: the same one-line ReportError."""
    data = ticked_run()
    for rec in data["logs"][1]:
        if rec["type"] == "run_start":
            rec["schema"] = 999
    d = write(tmp_path / "run", data)
    with pytest.raises(ReportError) as alone:
        load_run(d, second_core=False)
    with pytest.raises(ReportError) as both:
        load_run(d)
    assert str(both.value) == str(alone.value)
    assert json.dumps(str(both.value)).count("\\n") == 0
