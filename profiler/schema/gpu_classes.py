"""The classes a span's GPU window gets (profiler/gpu_lag.py places the samples; readers classify a window's counts
with class_of). Standard library only: the schema's readers need it without the core."""
from __future__ import annotations

LAUNCH, GPU, MIXED = "launch-bound", "GPU-bound", "mixed"
CLASS_SHARE_MIN = 2 / 3
"""A span name is called launch- or GPU-bound in a window when at least this share of its samples is."""


def class_of(launch_bound: int, gpu_bound: int, n: int) -> str | None:
    """A span name's class over a window from its sample counts: launch- or GPU-bound when at least
    CLASS_SHARE_MIN of its samples are, mixed otherwise; None without samples."""
    if n <= 0:
        return None
    if launch_bound >= CLASS_SHARE_MIN * n:
        return LAUNCH
    if gpu_bound >= CLASS_SHARE_MIN * n:
        return GPU
    return MIXED
