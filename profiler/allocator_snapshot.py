"""`dflash-profile memory`: the CUDA caching allocator's snapshot, saved on demand by a live rank.

The endpoint's `memory` command (on its thread; no device sync) writes `torch.cuda.memory._snapshot()` as
RUN_DIR/forensics/rank{R}-memory-{unix_ms}.pickle, the format pytorch.org/memory_viz opens, with the allocation
history and its stack frames when the run keeps one (`--memory-history N`), and records a `memory_snapshot`
event with the open spans at that moment, which `dflash-report memory` shows beside the snapshot's summary.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path


def snapshot_path(run_dir, rank: int, unix_ms: int) -> Path:
    return Path(run_dir) / "forensics" / f"rank{rank}-memory-{unix_ms}.pickle"


def segment_totals(snapshot: dict) -> dict:
    """Reserved and allocated bytes over the snapshot's segments."""
    segments = snapshot.get("segments") or []
    return {"reserved_bytes": sum(s.get("total_size", 0) for s in segments),
            "allocated_bytes": sum(s.get("allocated_size", 0) for s in segments), "segments": len(segments)}


def save(run_dir, rank: int, device, history: bool, open_spans_fn, write_event, wall_clock) -> dict:
    """The endpoint's reply: the file written and its totals, after the `memory_snapshot` event."""
    import torch

    snapshot = torch.cuda.memory._snapshot(device)
    path = snapshot_path(run_dir, rank, int(wall_clock() * 1000))
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        pickle.dump(snapshot, f)
    os.replace(part, path)   # a reader never sees half a snapshot
    fields = {"file": str(path), "bytes": path.stat().st_size, "history": history, **segment_totals(snapshot)}
    write_event("memory_snapshot", **fields, open_spans=open_spans_fn())
    return {"ok": True, "rank": rank, **fields}


def no_allocator(rank: int, role: str):
    """The `memory` command of a rank without a CUDA device: one line saying so."""
    def reply(_request) -> dict:
        return {"ok": False, "error": f"rank {rank} ({role}) runs on the CPU: it has no CUDA allocator to snapshot"}
    return reply
