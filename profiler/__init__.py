"""Instrumentation core: spans, CUDA event timers, intervals, memory sampling, run log, control.

Public API (see README.md and docs/ARCHITECTURE.md):
    Profiler, active, span, count, gauge, metric, set_step, event, corrupt, read_records.
This package never imports `dflash`; it works in any training loop.
"""
from profiler.api import active, corrupt, count, event, gauge, metric, set_step, span
from profiler.core import Profiler
from profiler.runlog import read_records

__all__ = ["Profiler", "active", "span", "count", "gauge", "metric", "set_step", "event", "corrupt",
           "read_records"]
