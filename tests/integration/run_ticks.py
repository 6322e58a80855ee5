"""The run log's `tick` records as the Prometheus tests read them: cumulative counters and span seconds at known
Unix times."""
from __future__ import annotations

import json
from pathlib import Path


def ticks(run: Path, rank: int) -> list:
    """The rank's tick records, in the order written."""
    lines = (run / "profile" / f"rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "tick"]


def value_at(tks: list, t: float, read) -> float:
    """`read(tick)` (a cumulative figure) at Unix time t: linear between the ticks around it."""
    for a, b in zip(tks, tks[1:]):
        if a["time_unix"] <= t <= b["time_unix"]:
            va, vb = read(a), read(b)
            width = b["time_unix"] - a["time_unix"]
            return va if width <= 0 else va + (vb - va) * (t - a["time_unix"]) / width
    raise AssertionError(f"{t} lies outside the ticks")


def tokens_at(tks: list, t: float) -> float:
    """The run log's tokens at Unix time t."""
    return value_at(tks, t, lambda tick: tick["counters"].get("tokens", 0))


def span_seconds_at(tks: list, span: str, t: float) -> float:
    """The run log's cumulative CPU seconds of `span` at Unix time t (a tick credits open spans up to its
    instant)."""
    return value_at(tks, t, lambda tick: ((tick.get("spans") or {}).get(span) or {}).get("cpu_seconds", 0.0))


def tokens_rate(tks: list, t0: float, t1: float) -> float:
    """The run log's tokens/s over [t0, t1], the window clipped to the ticks' span."""
    t0, t1 = max(t0, tks[0]["time_unix"]), min(t1, tks[-1]["time_unix"])
    return (tokens_at(tks, t1) - tokens_at(tks, t0)) / (t1 - t0) if t1 > t0 else 0.0
