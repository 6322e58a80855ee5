"""The time a span entry of an interval (or run_end) record stands for, one way for every reader.

GPU times when measured (what `share` uses), else CPU. A CPU total is cut at the window's edges; a GPU
total is never cut, and is scaled to all spans when only some were GPU-timed. Standard library only.
"""
from __future__ import annotations


def basis(entry: dict) -> tuple[dict, str]:
    """(stats, "gpu"|"cpu"): the stats a span's times are read from."""
    if entry.get("gpu"):
        return entry["gpu"], "gpu"
    return entry.get("cpu") or {}, "cpu"


def gpu_scale(entry: dict) -> float:
    """count / gpu_count: what the entry's GPU total is multiplied by to stand for all its spans; 1.0 when
    every span was timed, or for logs written before gpu_count existed."""
    timed = entry.get("gpu_count")
    return (entry.get("count") or 0) / timed if timed else 1.0


def basis_seconds(entry: dict) -> float:
    """The entry's time in its window: the GPU total scaled to all its spans, else the CPU total."""
    stats, on = basis(entry)
    return (stats.get("total_seconds") or 0.0) * (gpu_scale(entry) if on == "gpu" else 1.0)


def whole_seconds(entry: dict) -> float:
    """The summed durations of the spans the entry counts, each whole (the sum behind its mean): on the GPU
    the scaled total, on the CPU mean x count (the CPU total is cut at the window's edges)."""
    stats, on = basis(entry)
    if on == "gpu":
        return basis_seconds(entry)
    mean = stats.get("mean_seconds")
    return mean * (entry.get("count") or 0) if mean is not None else 0.0


def open_at_end(open_spans: list | None) -> dict:
    """{span name: [(thread, open_seconds), ...]} from an interval's `open_spans`: the spans still open
    when it closed, the longest open first."""
    out: dict = {}
    for entry in open_spans or ():
        for s in entry.get("spans") or ():
            out.setdefault(s.get("name"), []).append((entry.get("thread"), s.get("open_seconds") or 0.0))
    return {name: sorted(v, key=lambda t: -t[1]) for name, v in out.items()}
