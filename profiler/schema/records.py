"""Reading run logs: record kinds, the schema version, and tolerant readers. Standard library only (orjson where it
is installed: a package dependency), so `dflash-report` and `dflash-profile` read run logs without importing torch
(docs/RUNLOG.md)."""
from __future__ import annotations

import json
import re
from pathlib import Path

SCHEMA_VERSION = 1
RUN_START, INTERVAL, TICK, SPANS, EVENT, SNAPSHOT, RUN_END = (
    "run_start", "interval", "tick", "spans", "event", "snapshot", "run_end")
RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


MAX_NESTING = 64
"""Brackets a record may nest (ours nest under 10): json.loads recurses once per level, so a deeper line (a
corrupted or hostile log) is a bad line, never a RecursionError in a reader."""
_NOT_BRACKETS_OR_QUOTES = bytes(range(256)).translate(None, b'[]{}"')


def _brackets(raw: bytes) -> bytes:
    """The line's brackets outside its JSON strings, in order: escaped backslashes, then escaped quotes, are dropped
    first (escapes pair left to right), so every quote left opens or closes a string."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # two adjacent quotes open and close a string without brackets, or close one and open the next: dropping the
    # pair changes no bracket's side of the quotes, and leaves few quotes (often none) to split on
    kept = raw.translate(None, _NOT_BRACKETS_OR_QUOTES).replace(b'""', b"")
    return b"".join(kept.split(b'"')[::2]) if b'"' in kept else kept


def too_deep(raw: bytes, limit: int = MAX_NESTING) -> bool:
    """Whether the JSON line nests brackets deeper than `limit`, found without recursing (C-speed byte passes:
    each drops the innermost pairs); a cut line's unclosed brackets count when there are more than `limit`."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _brackets(raw)
    for _ in range(limit):
        if not brackets:
            return False
        inner_removed = brackets.replace(b"{}", b"").replace(b"[]", b"")
        if inner_removed == brackets:   # unbalanced (a cut line): json.loads says so
            return len(brackets) > limit
        brackets = inner_removed
    return bool(brackets)


try:
    from orjson import loads as _fast_loads
except ImportError:   # a host that installed the package without its dependencies: the standard library's
    _fast_loads = json.loads


def loads(raw: bytes):
    """json.loads(raw), about twice as fast on run logs through orjson; anything orjson refuses (a NaN literal, a
    lone surrogate escape) goes to json.loads, whose verdict it is: the same records and the same bad lines either
    way, but for an integer beyond 64 bits, which orjson reads as a float of its value (no field of a run log holds
    one). Brackets nested past MAX_NESTING are the caller's to refuse first."""
    try:
        return _fast_loads(raw)
    except ValueError:   # orjson.JSONDecodeError is one
        return json.loads(raw)


def parse_line(raw: bytes):
    """One run-log line -> its record (a dict), or None for a line that is not one: not JSON, not an object, or
    nested deeper than MAX_NESTING."""
    if too_deep(raw):
        return None
    try:
        rec = loads(raw)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def read_records(path) -> tuple[list, int]:
    """Read one run log -> (records, n_bad), line by line. A line that is not a JSON object (a truncated last line
    after a crash, one glued to a later run's first record, one nested too deep) is dropped and counted, never
    raised."""
    records, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            rec = parse_line(raw)
            if rec is None:
                bad += 1
            else:
                records.append(rec)
    return records, bad


def rank_logs(run_dir) -> dict:
    """{rank: path} of RUN_DIR/profile/rank{R}.jsonl, in rank order (empty when there are none)."""
    profile = Path(run_dir) / "profile"
    matches = ((RANK_FILE.match(p.name), p) for p in (profile.iterdir() if profile.is_dir() else ()))
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
