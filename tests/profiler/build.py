"""Profilers for tests: keyword knobs sorted into the ProfilerConfig and ProfilerDeps they belong to."""
from __future__ import annotations

from dataclasses import fields

import profiler
from profiler.config import ProfilerConfig, ProfilerDeps

_CONFIG = {f.name for f in fields(ProfilerConfig)}
_DEPS = {f.name for f in fields(ProfilerDeps)}


def make_profiler(run_dir, **kw) -> profiler.Profiler:
    """profiler.Profiler(run_dir, ...) with each keyword that names a ProfilerConfig or ProfilerDeps field put
    there; the rest (rank, role, device, run_config, exporters, ...) go to the Profiler as they are."""
    config = {k: kw.pop(k) for k in list(kw) if k in _CONFIG}
    deps = {k: kw.pop(k) for k in list(kw) if k in _DEPS}
    return profiler.Profiler(run_dir, config=ProfilerConfig(**config), deps=ProfilerDeps(**deps), **kw)
