"""Reading run logs: record kinds, the schema version, and tolerant readers. Standard library only,
so `dflash-report` and `dflash-profile` read run logs without importing torch (docs/RUNLOG.md)."""
from __future__ import annotations

import json
import re
from pathlib import Path

SCHEMA_VERSION = 1
RUN_START, INTERVAL, TICK, SPANS, EVENT, SNAPSHOT, RUN_END = (
    "run_start", "interval", "tick", "spans", "event", "snapshot", "run_end")
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


def read_records(path) -> tuple[list, int]:
    """Read one run log -> (records, n_bad). A line that is not a JSON object (a truncated last line after a
    crash, or one glued to a later run's first record) is dropped and counted, never raised."""
    with open(path, "rb") as f:
        data = f.read()
    records, bad = [], 0
    for raw in filter(bytes.strip, data.split(b"\n")):
        try:
            rec = json.loads(raw)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def rank_logs(run_dir) -> dict:
    """{rank: path} of RUN_DIR/profile/rank{R}.jsonl, in rank order (empty when there are none)."""
    profile = Path(run_dir) / "profile"
    matches = ((_RANK_FILE.match(p.name), p) for p in (profile.iterdir() if profile.is_dir() else ()))
    return dict(sorted((int(m.group(1)), p) for m, p in matches if m and p.is_file()))


def check_schema(run_start: dict, where: str = "run log") -> int:
    """The record's schema version; ValueError for a version newer than this reader knows.
    Logs written before schema 1 carry none and read as 0."""
    version = run_start.get("schema", 0)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"{where}: schema {version!r} is newer than this reader's {SCHEMA_VERSION}; "
                         "upgrade dflash-observability")
    return version


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)}


def printable(text: str) -> str:
    """`text` with its control characters escaped (`\\x1b`...), newline and tab kept: a string from a log,
    a socket or another process cannot move the cursor, retitle the window or write the clipboard."""
    return text.translate(_CONTROL)
