"""The transfer flight recorders of a failed run, lined up. A hang, crash, OOM, forced stop or lost peer dumps
each rank's last transfer-protocol steps in its event's `extra`; per target -> drafter link this says how far
each side got, and which batches were in flight.
"""
from __future__ import annotations

from report.runs import Run

FORENSIC_KINDS = ("hang", "thread_crash", "oom", "signal", "peer_lost")


def _last_ring(log) -> tuple[dict | None, list]:
    """The rank's last forensics event that carries a transfer ring, and the ring."""
    for ev in reversed(log.events):
        ring = (ev.get("extra") or {}).get("transfer_ring")
        if ev.get("kind") in FORENSIC_KINDS and isinstance(ring, list):
            return ev, ring
    return None, []


def _last_batch(ring: list, kind: str, peer_key: str, peer) -> int | None:
    batches = [e.get("batch") for e in ring if e.get("kind") == kind and e.get(peer_key) == peer
               and isinstance(e.get("batch"), int)]
    return max(batches) if batches else None


def transfer_rings(run: Run) -> dict:
    """{"dumps": [{rank, role, kind, entries, last}], "links": [{target, drafter, submitted, completed, received,
    in_flight, verdict}]}; empty when no rank dumped a ring."""
    dumps, rings = [], {}
    for rank, log in run.ranks.items():
        ev, ring = _last_ring(log)
        if ev is None:
            continue
        rings[rank] = (log.role, ring)
        dumps.append({"rank": rank, "role": log.role, "kind": ev.get("kind"), "entries": len(ring),
                      "last": ring[-1] if ring else None})
    links = []
    for t, (role, ring) in rings.items():
        if role != "target":
            continue
        for dst in sorted({e.get("dst") for e in ring if e.get("kind") == "submit" and e.get("dst") is not None}):
            links.append(_link(t, ring, dst, rings.get(dst)))
    return {"dumps": dumps, "links": links}


def _link(target: int, ring: list, drafter: int, drafter_ring) -> dict:
    submitted = _last_batch(ring, "submit", "dst", drafter)
    completed = _last_batch(ring, "completed", "dst", drafter)
    received = _last_batch(drafter_ring[1], "received", "src", target) if drafter_ring else None
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
