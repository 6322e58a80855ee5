"""Run log: whole lines, round trip, truncated last line, concurrent writers."""
import json
import threading

from profiler.runlog import RunLog, read_records


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
