"""`dflash-report memory RUN_DIR`: the CUDA allocator snapshots a run saved under RUN_DIR/forensics/ (on demand by
`dflash-profile memory`, or at an out-of-memory error with `--memory-history N`), summarised offline: reserved
against allocated, fragmentation, the largest live blocks with the frames that allocated them, and the spans
that were open when it was taken (from the run log's `memory_snapshot` event).

Loading a snapshot executes nothing from the file. A snapshot is a pickle (the format pytorch.org/memory_viz
opens), and unpickling can call any function the file names; PlainUnpickler is a pickle.Unpickler whose
find_class refuses every global, so only plain containers (dicts, lists, tuples, strings, numbers, booleans,
None) can come out of it, and a file that names a class or a function (`posix.system`, say) is refused in one
line. Standard library only.
"""
from __future__ import annotations

import pickle
import re
from pathlib import Path

from profiler.report.runs import ReportError, load_run

TOP = 10
FRAMES = 3
_ALLOCATOR_FRAMES = ("unwind", "CapturedTraceback", "gather_with_cpp", "CachingAllocator")
"""Native frames of the snapshot's own machinery, left out where a block has no Python frame."""
_NAME = re.compile(r"^rank(\d+)-(memory|oom)-(\d+)(-memory)?\.pickle$")


class PlainUnpickler(pickle.Unpickler):
    """Builds plain containers only: any global the pickle names (a class, a function) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused: the pickle names {module}.{name}, and a memory snapshot holds only "
                                     "plain containers (nothing in it is run)")


def load_snapshot(path: Path) -> dict:
    """The snapshot as plain containers; ReportError (one line) for a file that is not one."""
    try:
        with open(path, "rb") as f:
            snap = PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, OSError) as exc:
        raise ReportError(f"{path}: {exc}") from None
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise ReportError(f"{path}: not a CUDA allocator snapshot (no segments list)")
    return snap


def _frames(block: dict) -> list:
    """The innermost Python frames outside torch that allocated the block (else torch's Python frames, else the
    innermost frames at all: a snapshot's frames mix C++ and Python, innermost first)."""
    frames = [f for f in block.get("frames") or [] if isinstance(f, dict)]
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")
              or str(f.get("filename", "")).startswith("<")]
    own = [f for f in python if "/torch/" not in str(f.get("filename"))]
    native = [f for f in frames if not any(m in str(f.get("name")) for m in _ALLOCATOR_FRAMES)]
    return [f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in (own or python or native)[:FRAMES]]


def summarise(snap: dict, top: int = TOP) -> dict:
    """Reserved and allocated bytes, fragmentation, the largest live and free blocks of one snapshot."""
    segments = [s for s in snap["segments"] if isinstance(s, dict)]
    blocks = [b for s in segments for b in s.get("blocks") or [] if isinstance(b, dict)]
    reserved = sum(s.get("total_size", 0) for s in segments)
    allocated = sum(s.get("allocated_size", 0) for s in segments)
    live = sorted((b for b in blocks if b.get("state") == "active_allocated"), key=lambda b: -b.get("size", 0))
    free = [b.get("size", 0) for b in blocks if b.get("state") == "inactive"]
    split_free = sum(b.get("size", 0) for s in segments if s.get("allocated_size", 0) > 0
                     for b in s.get("blocks") or [] if b.get("state") == "inactive")
    traces = snap.get("device_traces") or []
    return {"reserved_bytes": reserved, "allocated_bytes": allocated, "segments": len(segments),
            "requested_bytes": sum(s.get("requested_size", 0) for s in segments),
            "unallocated_share": 1 - allocated / reserved if reserved else None,
            "fragmentation": split_free / reserved if reserved else None,
            "free_in_used_segments_bytes": split_free, "largest_free_block_bytes": max(free, default=0),
            "live_blocks": len(live), "history_entries": sum(len(t) for t in traces if isinstance(t, list)),
            "largest_live_blocks": [{"bytes": b.get("size", 0), "requested_bytes": b.get("requested_size"),
                                     "stream": b.get("stream"), "frames": _frames(b)} for b in live[:top]]}


def _events_by_file(run) -> dict:
    """The run-log event naming each snapshot file: `memory_snapshot`, or an `oom` with its history file."""
    out = {}
    for log in run.ranks.values():
        for ev in log.events:
            path = ev.get("file") if ev.get("kind") == "memory_snapshot" else ev.get("memory_history_file")
            if isinstance(path, str):
                out[Path(path).name] = ev
    return out


def memory(run_dir, top: int = TOP) -> dict:
    """Every snapshot under RUN_DIR/forensics, oldest first; ReportError when there is none or one is refused."""
    run = load_run(run_dir)
    paths = sorted((p for p in (Path(run_dir) / "forensics").glob("*.pickle") if _NAME.match(p.name)),
                   key=lambda p: int(_NAME.match(p.name).group(3)))
    if not paths:
        raise ReportError(f"{run_dir}: no allocator snapshots in {Path(run_dir) / 'forensics'} (take one with "
                          "`dflash-profile memory --run-dir` on a live GPU run)")
    events = _events_by_file(run)
    snaps = []
    for path in paths:
        m, ev = _NAME.match(path.name), events.get(path.name) or {}
        snaps.append({"file": str(path), "rank": int(m.group(1)), "taken": "on demand" if m.group(2) == "memory"
                      else "at an out-of-memory error", "time_unix": int(m.group(3)) / 1000, "step": ev.get("step"),
                      "open_spans": ev.get("open_spans") or [], **summarise(load_snapshot(path), top)})
    return {"run_dir": str(run_dir), "snapshots": snaps}


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_memory(rep: dict) -> str:
    lines = []
    for s in rep["snapshots"]:
        frag = "-" if s["fragmentation"] is None else f"{100 * s['fragmentation']:.1f}%"
        lines += [f"{s['file']} (rank {s['rank']}, {s['taken']}, step {s['step']}):",
                  f"  {_gib(s['allocated_bytes'])} allocated of {_gib(s['reserved_bytes'])} reserved in "
                  f"{s['segments']} segments; free inside used segments {_gib(s['free_in_used_segments_bytes'])} "
                  f"({frag} of reserved: fragmentation); largest free block {_gib(s['largest_free_block_bytes'])}; "
                  f"{s['live_blocks']} live blocks; " + (f"{s['history_entries']} history entries" if
                                                         s["history_entries"] else "no allocation history")]
        for t in s["open_spans"]:
            nested = " > ".join(f"{x['name']} {x['open_seconds']:.2f} s" for x in t.get("spans") or [])
            lines.append(f"  open on {t.get('thread')}: {nested}")
        for b in s["largest_live_blocks"]:
            lines.append(f"  live {b['bytes'] / 2**20:9.1f} MiB  " + (" < ".join(b["frames"]) or "(no frames: "
                                                                      "run with --memory-history N)"))
    return "\n".join(lines)
