"""The run log's `tick` records as the Prometheus tests read them: cumulative counters at known Unix times."""
from __future__ import annotations

import json
from pathlib import Path


def ticks(run: Path, rank: int) -> list:
    """The rank's tick records, in the order written."""
    lines = (run / "profile" / f"rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "tick"]


def tokens_at(tks: list, t: float) -> float:
    """The run log's tokens at Unix time t: linear between the ticks around it."""
    for a, b in zip(tks, tks[1:]):
        if a["time_unix"] <= t <= b["time_unix"]:
            ca, cb = a["counters"].get("tokens", 0), b["counters"].get("tokens", 0)
            span = b["time_unix"] - a["time_unix"]
            return ca if span <= 0 else ca + (cb - ca) * (t - a["time_unix"]) / span
    raise AssertionError(f"{t} lies outside the ticks")


def tokens_rate(tks: list, t0: float, t1: float) -> float:
    """The run log's tokens/s over [t0, t1], the window clipped to the ticks' span."""
    t0, t1 = max(t0, tks[0]["time_unix"]), min(t1, tks[-1]["time_unix"])
    return (tokens_at(tks, t1) - tokens_at(tks, t0)) / (t1 - t0) if t1 > t0 else 0.0
