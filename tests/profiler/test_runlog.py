"""Run log: whole lines, round trip, truncated last line, concurrent writers, a full disk."""
import errno
import json
import os
import threading

import pytest

from profiler.runlog import RESERVE_BYTES, RunLog, read_records


def test_round_trip_and_types(tmp_path):
    path = tmp_path / "profile" / "rank0.jsonl"
    log = RunLog(path)
    recs = [{"type": "run_start", "rank": 0, "path": tmp_path, "tags": ("a", "b")},
            {"type": "interval", "loss": float("nan"), "x": [1, 2.5]}]
    for r in recs:
        log.write(r)
    log.close()
    back, bad = read_records(path)
    assert bad == 0 and len(back) == 2
    assert back[0]["path"] == str(tmp_path) and back[0]["tags"] == ["a", "b"]
    # Non-finite numbers are never bare NaN (not JSON): null, with the reason beside it.
    assert back[1]["loss"] is None and back[1]["reasons"] == {"loss": "non-finite: nan"}
    assert b"NaN" not in path.read_bytes() and path.read_bytes().endswith(b"\n")
    json.loads(path.read_bytes().splitlines()[1])   # strict JSON parsers accept every line


def test_truncated_last_line_is_dropped_and_counted(tmp_path):
    path = tmp_path / "r.jsonl"
    log = RunLog(path)
    for i in range(3):
        log.write({"type": "event", "i": i})
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"type": "interval", "spans": {"tar')   # a crash mid-write
    back, bad = read_records(path)
    assert [r["i"] for r in back] == [0, 1, 2] and bad == 1
    # a later run appending after the truncated fragment: only the glued line is lost
    log = RunLog(path)
    log.write({"type": "run_start", "i": 9})
    log.write({"type": "run_end", "i": 10})
    log.close()
    back, bad = read_records(path)
    assert [r["i"] for r in back] == [0, 1, 2, 10] and bad == 1


def test_concurrent_writers_produce_whole_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    log = RunLog(path)
    n_threads, per = 8, 200
    payload = "x" * 5000                                 # longer than a pipe/page-sized write

    def work(k):
        for i in range(per):
            log.write({"type": "event", "thread": k, "i": i, "payload": payload})
    ts = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == n_threads * per + 1
    seen = set()
    for line in lines[:-1]:
        r = json.loads(line)
        assert r["payload"] == payload
        seen.add((r["thread"], r["i"]))
    assert len(seen) == n_threads * per
    # each thread's own records stay in order
    back, bad = read_records(path)
    assert bad == 0
    for k in range(n_threads):
        assert [r["i"] for r in back if r["thread"] == k] == list(range(per))


def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_keeps_only_the_frame_and_counts_the_rest(tmp_path):
    """Issue 34 row 7: once the reserve past the end cannot be topped up, only run_start and run_end go in (the
    reserve's room), and the log says why; nothing raises into the writers."""
    calls = []
    log = RunLog(tmp_path / "r.jsonl", reserve_bytes=4096, reserve=lambda fd, at, n: calls.append((at, n)))
    log.write({"type": "run_start"})
    assert log.full is None and calls[0] == (0, 4096)
    log._reserve = _no_space                      # the disk filled since
    log.write({"type": "interval", "pad": "x" * 3000})   # past half the reserve: the top-up finds it full
    assert log.full is not None and log.full.errno == errno.ENOSPC and log.full.filename == str(log.path)
    log.write({"type": "interval", "i": 2})
    log.write({"type": "event", "kind": "x"})
    log.write({"type": "run_end", "status": "DiskFullStop"})
    log.close()
    back, bad = read_records(log.path)
    assert bad == 0 and [r["type"] for r in back] == ["run_start", "interval", "run_end"] and log.dropped == 2


def test_a_write_the_disk_cannot_take_is_cut_back_to_the_last_whole_line(tmp_path, monkeypatch):
    """A short write (the disk filled mid-line), then ENOSPC: the part that got in is truncated away."""
    log = RunLog(tmp_path / "r.jsonl", reserve=None)
    log.write({"type": "run_start"})
    whole = log.path.read_bytes()
    real_write, calls = os.write, []

    def half_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        _no_space()
    monkeypatch.setattr(os, "write", half_then_full)
    log.write({"type": "interval", "pad": "y" * 1000})
    monkeypatch.setattr(os, "write", real_write)
    assert len(calls) == 2 and log.path.read_bytes() == whole and log.full is not None and log.dropped == 1
    log.write({"type": "run_end"})
    log.close()
    back, bad = read_records(log.path)
    assert bad == 0 and [r["type"] for r in back] == ["run_start", "run_end"]


def test_another_error_is_raised_with_the_line_cut_back(tmp_path, monkeypatch):
    log = RunLog(tmp_path / "r.jsonl", reserve=None)
    log.write({"type": "run_start"})
    whole = log.path.read_bytes()
    real_write = os.write

    def half_then_eio(fd, data):
        real_write(fd, data[:10])
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(os, "write", half_then_eio)
    with pytest.raises(OSError, match="I/O error"):
        log.write({"type": "event"})
    monkeypatch.setattr(os, "write", real_write)
    assert log.path.read_bytes() == whole and log.full is None


def test_the_reserve_is_allocated_past_the_end_and_given_back_at_close(tmp_path):
    log = RunLog(tmp_path / "r.jsonl")
    log.write({"type": "run_start"})
    size = log.path.stat().st_size
    if log._reserve is None:
        pytest.skip("this file system keeps no reserve (no fallocate KEEP_SIZE)")
    assert log.path.stat().st_blocks * 512 >= RESERVE_BYTES and log.path.stat().st_size == size
    log.close()
    assert log.path.stat().st_blocks * 512 < RESERVE_BYTES and log.path.stat().st_size == size
