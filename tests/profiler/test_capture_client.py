"""The `dflash-profile capture` / `memory` client's own parts: the common start step, the run-log tail it waits
on (whole lines only), and its words."""
from __future__ import annotations


def test_the_client_rounds_up_reads_whole_lines_and_words_its_answers(tmp_path):
    from profiler.clients.capture_client import LogTail, format_capture, format_memory, roundup

    assert roundup(7) == 10 and roundup(8) == 10 and roundup(9) == 20 and roundup(41, 5) == 45
    log = tmp_path / "rank0.jsonl"
    log.write_text('{"type": "run_start"}\n')
    tail = LogTail(log)   # what was there before it opened is not new
    with open(log, "a") as f:
        f.write('{"type": "event", "kind": "capture", "step": 10}\n{"type": "ev')
    assert tail.new_records() == [{"type": "event", "kind": "capture", "step": 10}]
    with open(log, "a") as f:
        f.write('ent"}\n')
    assert tail.new_records() == [{"type": "event"}]   # the half line, once whole
    armed = {"at_step": 10, "steps": 2, "ranks": [{"rank": 0, "role": "drafter", "pid": 5, "at_step": 10,
                                                    "file": "R/kineto/rank0-step10.json.gz"}]}
    assert format_capture(armed).splitlines() == [
        "capture of steps 10-11 (2 steps) on 1 rank(s):",
        "  rank 0 (drafter, pid 5): armed at step 10, will write R/kineto/rank0-step10.json.gz"]
    done = dict(armed, ranks=[{"rank": 1, "role": "target", "pid": 6, "files": ["F"], "steps": [10, 11],
                               "bytes": 2_000_000, "bytes_per_step": 1_000_000, "captured_spans": [{}] * 4},
                              {"rank": 0, "role": "drafter", "pid": 5, "error": "the rank ended before its capture"}])
    assert format_capture(done).splitlines()[1:] == [
        "  rank 1 (target, pid 6): F  steps 10-11, 2.00 MB (1.00 MB a step), 4 spans",
        "  rank 0 (drafter, pid 5): the rank ended before its capture"]
    assert format_memory([{"ok": True, "rank": 0, "role": "drafter", "pid": 5, "file": "S", "allocated_bytes": 2**30,
                           "reserved_bytes": 2**31, "segments": 3, "history": False}]) == (
        "rank 0 (drafter, pid 5): S  1.00 GiB allocated of 2.00 GiB reserved in 3 segments (no allocation history: "
        "--memory-history N keeps one)")
