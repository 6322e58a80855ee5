"""The report on long and hostile run logs: linear in the log (a 30,000-interval log through hotspots and check in
seconds of CPU), detail windows kept to what a trace draws while the log streams by, and a deeply nested line
read as one bad line, never a RecursionError."""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from profiler import report
from profiler.schema import records as rl
from profiler.report.check import check
from profiler.report.runs import load_run
from profiler.report.trace import merge_traces

from tests.report.longlog import write_long_run

CPU_SECONDS_MAX = 10.0
DEEP = "[" * 100_000 + "]" * 100_000


def _cpu_seconds() -> float:
    """This process's CPU seconds and its reaped children's (check's second core)."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def test_a_30000_interval_log_reports_in_seconds(tmp_path):
    # CPU seconds, not wall: a busy machine slows the wall clock, not the work a quadratic path adds (2 x 4,000
    # intervals took 27 s with span_clock recomputed per entry; 2 x 15,000 would take minutes)
    run_dir = write_long_run(tmp_path / "long", 15_000)
    t = _cpu_seconds()
    rep = report.hotspots(run_dir)
    hot_s = _cpu_seconds() - t
    t = _cpu_seconds()
    res = check(run_dir)
    check_s = _cpu_seconds() - t
    assert rep["verdict"]["roles"]["drafter"]["window"] == "steady intervals (14998)"
    assert res.intervals == 30_000 and res.ranks == 2
    assert hot_s < CPU_SECONDS_MAX and check_s < CPU_SECONDS_MAX, (hot_s, check_s)


def test_detail_windows_are_kept_to_what_the_trace_draws(tmp_path):
    run_dir = write_long_run(tmp_path / "r", 300)
    run = load_run(run_dir, with_spans=True, max_events=40)
    assert [len(log.spans) for log in run.ranks.values()] == [20, 20]   # 40 slices over 2 ranks, 1 span a window
    assert [log.spans_evicted for log in run.ranks.values()] == [280, 280]
    assert [r["index"] for r in run.ranks[0].spans] == list(range(280, 300))   # the newest
    summary = merge_traces(run_dir, tmp_path / "t.json", max_events=40)
    assert (summary["evicted_spans"], summary["spans"]) == (560, 40)


def _with_line(run_dir: Path, line: str) -> Path:
    log = run_dir / "profile" / "rank0.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join([*lines[:5], line, *lines[5:]]) + "\n")
    return log


def test_a_deeply_nested_line_is_one_bad_line(tmp_path):
    run_dir = write_long_run(tmp_path / "r", 20)
    log = _with_line(run_dir, '{"type": "event", "kind": "x", "a": ' + DEEP + "}")
    run = load_run(run_dir)
    assert run.ranks[0].bad_lines == 1 and len(run.ranks[0].intervals) == 20
    assert run.ranks[0].bad_examples == [f"{log}:6: nested deeper than {rl.MAX_NESTING} brackets"]
    assert rl.read_records(log)[1] == 1
    assert merge_traces(run_dir, tmp_path / "t.json")["bad_lines"] == 1
    assert check(run_dir).intervals == 40
    assert report.hotspots(run_dir)["ranks"]["ranks"][0]["bad_lines"] == 1


def test_nesting_is_measured_outside_strings_and_within_the_limit():
    nested = lambda d: json.dumps({"a": json.loads("[" * d + "]" * d)}).encode()  # noqa: E731
    assert not rl.too_deep(nested(rl.MAX_NESTING - 1))          # the object's own level counts
    assert rl.too_deep(nested(rl.MAX_NESTING))
    assert not rl.too_deep(json.dumps({"text": "[" * 500}).encode())               # brackets in a string
    assert rl.too_deep(('[' + '"]", [' * 100 + "]" * 100 + "]").encode())          # closers in strings hide none
    assert rl.too_deep(json.dumps([{"q": 'a\\"]'}] * 1 + [0]).encode()[:-1] + b"[" * 100)
    deep = json.loads("[" * 100 + "]" * 100)
    assert rl.too_deep(json.dumps({"t": "ends in a backslash\\", "d": deep}).encode())   # "\\" then the quote
    assert not rl.too_deep(json.dumps({"t": 'quoted \\" [[[' * 40, "u": "\\\\[" * 70}).encode())
    assert rl.parse_line(DEEP.encode()) is None


def test_what_orjson_refuses_gets_the_standard_librarys_verdict(tmp_path):
    """records.loads reads through orjson where installed; a NaN literal and a lone surrogate escape (which orjson
    refuses and json reads) read as json reads them, in a batch and line by line; an integer over 64 bits reads as
    its value (a float, orjson's rule)."""
    odd = ['{"type": "event", "kind": "x", "big": 36893488147419103232}',
           '{"type": "event", "kind": "x", "text": "\\ud800"}',
           '{"type": "event", "kind": "x", "v": NaN}']
    for line in odd:
        assert rl.loads(line.encode()) == json.loads(line) or line.endswith("NaN}")
    assert rl.loads(b"[1, NaN]")[1] != rl.loads(b"[1, NaN]")[1]   # a NaN, as json.loads gives it
    run_dir = write_long_run(tmp_path / "r", 20)
    for line in odd:
        _with_line(run_dir, line)
    run = load_run(run_dir)
    assert run.ranks[0].bad_lines == 0 and len(run.ranks[0].intervals) == 20
    assert [e.get("big") for e in run.ranks[0].events if "big" in e] == [2 ** 65]
    assert [e["text"] for e in run.ranks[0].events if "text" in e] == ["\ud800"]
    try:
        import orjson
    except ImportError:
        return
    for line in odd[1:]:   # the inputs do exercise the fallback
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(line)


def test_brackets_outside_strings_skip_quote_pairs_without_one_between():
    """The quote pairs with no bracket between dropped first leave the brackets outside strings that splitting at
    every quote leaves (fuzzed over brackets, quotes, escapes and letters)."""
    def split_at_every_quote(raw: bytes) -> bytes:
        if b"\\" in raw:
            raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        return b"".join(raw.translate(None, rl._NOT_BRACKETS_OR_QUOTES).split(b'"')[::2])

    rng = random.Random(7)
    for _ in range(20_000):
        raw = bytes(rng.choice(b'[]{}"\\a:, ') for _ in range(rng.randint(0, 24)))
        assert rl._brackets(raw) == split_at_every_quote(raw), raw


def test_empty_rank_logs_are_counted_in_one_line_not_listed(tmp_path, capsys):
    from dflash import report_cli
    run_dir = write_long_run(tmp_path / "r", 20)
    for rank in range(2, 10_002):
        (run_dir / "profile" / f"rank{rank}.jsonl").touch()
    line = "10000 empty run logs (profile/rank*.jsonl of 0 bytes) left out, not counted as ranks"
    rep = report.hotspots(run_dir)
    assert rep["empty_logs"] == 10_000 and [r["rank"] for r in rep["ranks"]["ranks"]] == [0, 1]
    text = report.format_hotspots(rep)
    assert "unknown" not in text and text.count(line) == 1 and len(text.splitlines()) < 100
    res = check(run_dir)
    assert res.ranks == 2 and line in res.notes and not any("rank2.jsonl" in n for n in res.notes)
    assert merge_traces(run_dir, tmp_path / "t.json")["ranks"] == [0, 1]
    report_cli.main(["check", str(run_dir)])
    assert len(capsys.readouterr().err.splitlines()) < 20


def test_checks_flow_counts_are_the_merged_traces(tmp_path):
    from profiler.report.trace import flow_counts, merged_trace
    run_dir = write_long_run(tmp_path / "r", 30)
    for rank, name in ((0, "drafter.recv"), (1, "transfer.send")):   # batches 0..29, the drafter missing the last 3
        log = run_dir / "profile" / f"rank{rank}.jsonl"
        recs = [json.loads(line) for line in log.read_text().splitlines()]
        for rec in recs:
            if rec["type"] == "spans" and (rank == 1 or rec["index"] < 27):
                rec["spans"][0].update(name=name, attrs={"flow": f"1:{rec['index']}"})
        log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(run_dir, with_spans=True)
    counts = merged_trace(run)[1]
    assert flow_counts(run) == {"flows_matched": counts["flows_matched"], "flow_sends": counts["flow_sends"]}
    assert (counts["flows_matched"], counts["flow_sends"]) == (27, 30)
    assert flow_counts(run, max_events=20)["flow_sends"] == 10   # the same newest windows merged_trace keeps
