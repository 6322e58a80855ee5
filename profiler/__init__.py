"""Instrumentation core: spans, CUDA event timers, intervals, memory sampling, run log, control.

The public API is `__all__`; docs/API.md is its reference (README.md has a whole loop). It imports nothing of
ours, so it works in any training loop; `Profiler` (torch) loads on first use, so `profiler.schema.records` and
`profiler.clients.snapshot` need no torch.
"""
from profiler.api import (active, check_finite, check_flags, corrupt, count, disk_full, event, forensics, gauge,
                          in_detail, keep_step, memory_sizes, metric, nonfinite_found, note_disk_full, check_numerics, numerics_drift,
                          numerics_due, register_forensics, set_step, settle_nonfinite, span, tag)
from profiler.config import ProfilerConfig, ProfilerDeps
from profiler.schema.records import read_records

__all__ = ["Profiler", "ProfilerConfig", "ProfilerDeps", "active", "span", "count", "gauge", "metric", "set_step",
           "event", "corrupt", "tag", "read_records", "check_finite", "check_flags", "nonfinite_found",
           "settle_nonfinite", "register_forensics", "forensics", "in_detail", "keep_step", "disk_full",
           "note_disk_full", "check_numerics", "numerics_due", "numerics_drift", "memory_sizes"]


def __getattr__(name):
    if name == "Profiler":
        from profiler.core import Profiler
        return Profiler
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
