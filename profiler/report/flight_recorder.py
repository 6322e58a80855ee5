"""The transfer flight recorders of a failed run, lined up. A hang, crash, OOM, forced stop or lost peer dumps
each rank's last transfer-protocol steps in its event's `extra`; per target -> drafter link this says how far
each side got, and which batches were in flight.
"""
from __future__ import annotations

from operator import attrgetter

from profiler.schema import views
from profiler.report.runs import Run


def _last_ring(log) -> tuple:
    """The rank's last forensics event (hang, thread_crash, oom, signal, peer_lost: views.Forensics) that carries a
    transfer ring, and the ring (a list of views.RingEntry)."""
    for ev in map(views.event, reversed(log.events)):
        if isinstance(ev, views.Forensics) and (ring := ev.transfer_ring) is not None:
            return ev, ring
    return None, []


def _last_batch(ring: list, kind: str, peer_of, peer) -> int | None:
    """The last batch of the ring's `kind` entries whose peer (`peer_of(entry)`: its dst or src) is `peer`."""
    batches = [e.batch for e in ring if e.kind == kind and peer_of(e) == peer and e.batch is not None]
    return max(batches) if batches else None


_DST, _SRC = attrgetter("dst"), attrgetter("src")


def transfer_rings(run: Run) -> dict:
    """{"dumps": [{rank, role, kind, entries, last}], "links": [{target, drafter, submitted, completed, received,
    in_flight, verdict}]}; empty when no rank dumped a ring."""
    dumps, rings = [], {}
    for rank, log in run.ranks.items():
        ev, ring = _last_ring(log)
        if ev is None:
            continue
        rings[rank] = (log.role, ring)
        dumps.append({"rank": rank, "role": log.role, "kind": ev.kind, "entries": len(ring),
                      "last": ring[-1].raw if ring else None})
    links = []
    for t, (role, ring) in rings.items():
        if role != "target":
            continue
        for dst in sorted({e.dst for e in ring if e.kind == "submit" and e.dst is not None}):
            links.append(_link(t, ring, dst, rings.get(dst)))
    return {"dumps": dumps, "links": links}


def _link(target: int, ring: list, drafter: int, drafter_ring) -> dict:
    submitted = _last_batch(ring, "submit", _DST, drafter)
    completed = _last_batch(ring, "completed", _DST, drafter)
    received = _last_batch(drafter_ring[1], "received", _SRC, target) if drafter_ring else None
    link = {"target": target, "drafter": drafter, "submitted": submitted, "completed": completed,
            "received": received, "in_flight": []}
    if drafter_ring is None:
        link["verdict"] = f"drafter rank {drafter} left no ring: its side is unknown"
    elif submitted is None:
        link["verdict"] = "the target submitted nothing in its ring's window"
    elif received is None or received < submitted:
        first = -1 if received is None else received
        link["in_flight"] = list(range(first + 1, submitted + 1))
        which = f"batches {first + 1}..{submitted}" if submitted > first + 1 else f"batch {submitted}"
        link["verdict"] = f"{which} sent by rank {target} never reached rank {drafter}"
    else:
        link["verdict"] = f"every batch rank {target} submitted reached rank {drafter}"
    return link
