"""report.flight_recorder on rings as docs/RUNLOG.md shows them: each target -> drafter link says how far each side
got and which batches were in flight; the last forensics dump that holds a ring is the one read."""
from profiler.report.flight_recorder import transfer_rings
from profiler.report.runs import RankLog, Run


def _dump(kind: str, ring, rank: int, role: str) -> dict:
    return {"type": "event", "time_unix": 1.0, "rank": rank, "role": role, "kind": kind, "step": 3,
            "threads": [], "open_spans": [], "forensics_file": "f.txt", "extra": {"transfer_ring": ring}}


def _target_ring(submitted: int, completed: int, dst: int = 0) -> list:
    ring = [{"time_unix": 1.0, "kind": "submit", "thread": "target.main", "dst": dst, "batch": b, "ready": "done",
             "queued": 0} for b in range(submitted + 1)]
    return ring + [{"time_unix": 2.0, "kind": "completed", "thread": "target.sender", "dst": dst, "batch": b,
                    "in_flight": 0} for b in range(completed + 1)]


def _drafter_ring(received: int, src: int = 1) -> list:
    return [{"time_unix": 1.5, "kind": "received", "thread": "drafter.receiver", "src": src, "batch": b,
             "ready": "done", "queued": 1} for b in range(received + 1)]


def _run(target_events: list, drafter_events: list) -> Run:
    return Run(run_dir="r", ranks={0: RankLog(rank=0, role="drafter", hostname="h", events=drafter_events),
                                   1: RankLog(rank=1, role="target", hostname="h", events=target_events)})


def test_the_rings_line_up_per_link_and_name_the_batches_in_flight():
    stale = _dump("hang", _target_ring(1, 1), 1, "target")   # an earlier dump: the last one is read
    rep = transfer_rings(_run([stale, _dump("signal", _target_ring(6, 4), 1, "target"),
                               {"type": "event", "kind": "checkpoint", "extra": {"transfer_ring": []}}],
                              [_dump("hang", _drafter_ring(3), 0, "drafter")]))
    assert [(d["rank"], d["kind"], d["entries"]) for d in rep["dumps"]] == [(0, "hang", 4), (1, "signal", 12)]
    assert rep["dumps"][1]["last"] == {"time_unix": 2.0, "kind": "completed", "thread": "target.sender", "dst": 0,
                                       "batch": 4, "in_flight": 0}
    (link,) = rep["links"]
    assert (link["target"], link["drafter"], link["submitted"], link["completed"], link["received"]) == (1, 0, 6, 4, 3)
    assert link["in_flight"] == [4, 5, 6] and link["verdict"] == "batches 4..6 sent by rank 1 never reached rank 0"


def test_a_link_says_what_it_cannot_know_and_a_dump_without_a_ring_is_none():
    rep = transfer_rings(_run([_dump("oom", _target_ring(2, 2), 1, "target")],
                              [_dump("peer_lost", {"not": "a ring"}, 0, "drafter")]))
    assert [d["rank"] for d in rep["dumps"]] == [1]
    (link,) = rep["links"]
    assert link["verdict"] == "drafter rank 0 left no ring: its side is unknown" and link["received"] is None
    whole = transfer_rings(_run([_dump("thread_crash", _target_ring(2, 2), 1, "target")],
                                [_dump("hang", _drafter_ring(2), 0, "drafter")]))
    assert whole["links"][0]["verdict"] == "every batch rank 1 submitted reached rank 0"
    assert transfer_rings(_run([], [])) == {"dumps": [], "links": []}
