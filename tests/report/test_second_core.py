"""What the report hands a second core (report.background): check's per-rank invariants and flows, read rank by
rank in a child process, and a trace's count of the older detail windows. Each answer is the one process's."""
from __future__ import annotations

import gc
import json

import pytest

from profiler import report
import profiler.report.check as check_mod
import profiler.report.trace as trace_mod
from profiler.report.background import Background
from profiler.report.check import check
from profiler.report.runs import load_run
from profiler.report.trace import merge_traces

from tests.report.longlog import write_long_run
from tests.report.test_check import BROKEN, clean, write


def _both(monkeypatch, module, fn):
    """fn(1) with the module seeing one core, then fn(2) with two."""
    answers = []
    for n in (1, 2):
        monkeypatch.setattr(module, "cores", lambda n=n: n)
        answers.append(fn(n))
    return answers


@pytest.mark.parametrize("case", ["clean", "resumed", *BROKEN])
def test_a_check_on_two_cores_finds_what_one_finds(tmp_path, monkeypatch, case):
    run = clean(resumed=case == "resumed")
    if case in BROKEN:
        BROKEN[case][0](run)
    run_dir = write(tmp_path / "run", run)
    (run_dir / "profile" / "rank7.jsonl").touch()   # an empty log: noted once, first
    one, two = _both(monkeypatch, check_mod, lambda n: check(run_dir).to_json())
    assert one == two
    assert one["ok"] == (case in ("clean", "resumed"))


def test_a_long_check_on_two_cores_is_the_one_process_check(tmp_path, monkeypatch):
    run_dir = write_long_run(tmp_path / "r", 200)
    log = run_dir / "profile" / "rank1.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines[:9], "{not json", *lines[9:]]) + "\n")   # a bad line among the intervals
    one, two = _both(monkeypatch, check_mod, lambda n: check(run_dir).to_json())
    assert one == two and one["intervals"] == 400


def _with_older_windows(run_dir):
    """The long log's detail windows with profiler drops and a bad line among the older ones, a window on a line
    of another key order among the newest, and a cut last line."""
    log = run_dir / "profile" / "rank0.jsonl"
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    out = []
    for rec in recs:
        if rec["type"] == "spans":
            rec["dropped"] = rec["index"] % 3
            if rec["index"] == 290:
                out.append(json.dumps({"rank": 0, **rec}))
                continue
        out.append(json.dumps(rec))
        if rec["type"] == "spans" and rec["index"] == 5:
            out.append(json.dumps({"type": "spans", "rank": 0, "spans": 3}))
    log.write_text("\n".join(out) + '\n{"type": "spans", "rank": 0, "spans": [')
    return run_dir


def test_a_trace_on_two_cores_is_the_one_process_trace(tmp_path, monkeypatch):
    run_dir = _with_older_windows(write_long_run(tmp_path / "r", 300))
    one, two = _both(monkeypatch, trace_mod, lambda n: merge_traces(run_dir, tmp_path / f"{n}.json", max_events=40))
    assert {**one, "out": None} == {**two, "out": None}
    assert (tmp_path / "1.json").read_bytes() == (tmp_path / "2.json").read_bytes()
    assert one["bad_lines"] == 2 and one["evicted_spans"] == 560


def test_the_newest_windows_read_back_are_the_ones_kept_streaming(tmp_path):
    run_dir = _with_older_windows(write_long_run(tmp_path / "r", 300))
    every = load_run(run_dir, with_spans=True, max_events=40)
    newest = load_run(run_dir, with_spans=True, max_events=40, read_older=False)
    for rank, log in every.ranks.items():
        mine = newest.ranks[rank]
        assert (mine.spans, mine.intervals, mine.events, mine.run_starts, mine.role) == \
            (log.spans, log.intervals, log.events, log.run_starts, log.role)
        assert mine.spans_evicted is None and mine.spans_profiler_dropped is None
    assert [r["index"] for r in newest.ranks[0].spans] == list(range(280, 300))
    assert (every.ranks[0].bad_lines, newest.ranks[0].bad_lines) == (2, 1)   # the older window's line unread


def test_a_detail_window_line_holding_another_record_is_read_in_file_order(tmp_path):
    run_dir = write_long_run(tmp_path / "r", 30)
    log = run_dir / "profile" / "rank0.jsonl"
    with open(log, "a") as f:   # a duplicate key: json keeps the last, an event
        f.write('{"type": "spans", "rank": 0, "type": "event", "kind": "hand-made"}\n')
    newest = load_run(run_dir, with_spans=True, max_events=40, read_older=False)
    every = load_run(run_dir, with_spans=True, max_events=40)
    assert newest.ranks[0].events == every.ranks[0].events and newest.ranks[0].events[-1]["kind"] == "hand-made"
    assert newest.ranks[0].spans_evicted == every.ranks[0].spans_evicted == 10


def test_a_childs_error_is_raised_here_and_a_dead_childs_work_done_here():
    with pytest.raises(ValueError, match="invalid literal"):
        Background(int, "not a number").result()
    job = Background(sum, [1, 2, 3])
    job._proc.kill()   # killed before it could answer (or after: either way the answer is 6)
    assert job.result() == 6
    with Background(sum, [4]) as unasked:   # a child never asked is stopped at the block's end
        pass
    assert not unasked._proc.is_alive()


def test_hotspots_then_compare_reads_the_run_once(tmp_path, monkeypatch):
    run_dir, base = write_long_run(tmp_path / "r", 20), write_long_run(tmp_path / "b", 20)
    reads = []
    real = report.load_run
    monkeypatch.setattr(report, "load_run", lambda d, *a, **k: reads.append(d) or real(d, *a, **k))
    report.hotspots(run_dir)
    table = report.compare(run_dir, run_dir)
    assert reads == [run_dir] and table == report.compare(run_dir, run_dir)
    assert gc.get_freeze_count() == 0   # the held run handed back to the collector
    reads.clear()
    report.hotspots(run_dir)
    report.compare(base, run_dir)   # `hotspots RUN --compare BASE`
    assert reads == [run_dir, base]
    reads.clear()
    report.hotspots(run_dir)
    with open(run_dir / "profile" / "rank0.jsonl", "a") as f:   # written to since: read again
        f.write('{"type": "event", "kind": "late"}\n')
    report.compare(base, run_dir)
    assert reads == [run_dir, base, run_dir]
