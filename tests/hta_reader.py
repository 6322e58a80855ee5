"""Holistic Trace Analysis (HTA) for the tests that read our Kineto captures with it. Its maintained distribution is
traceinsight (0.6 on); HolisticTraceAnalysis stops at 0.5.0. Both install the one module `hta`, and traceinsight
keeps `hta.trace_analysis.TraceAnalysis` and the breakdowns' names and columns, so the import is the same whichever
is installed: `provider()` names which one it is. A test dependency only
(scripts/setup.sh installs traceinsight with --no-deps); the product never imports it."""
from __future__ import annotations

import importlib
from importlib import metadata
from importlib.util import find_spec

import pytest

DISTRIBUTIONS = ("traceinsight", "HolisticTraceAnalysis")
"""The distributions that install the module `hta`, the maintained one first."""
MISSING = ("needs Holistic Trace Analysis (the module hta): neither traceinsight nor the older "
           "HolisticTraceAnalysis is installed (scripts/setup.sh installs traceinsight)")


def provider() -> str | None:
    """The distribution the importable `hta` comes from and its version ('traceinsight 0.6.1'), or None where
    neither is installed. Where both are (each overwrites the other's files: scripts/setup.sh removes the old one
    first), the one whose version the module reports; traceinsight on a tie."""
    installed = {}
    for name in DISTRIBUTIONS:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if not installed or find_spec("hta") is None:
        return None
    loaded = getattr(importlib.import_module("hta"), "__version__", None)
    name = next((n for n, v in installed.items() if v == loaded), next(iter(installed)))
    return f"{name} {installed[name]}"


def trace_analysis():
    """`hta.trace_analysis` (TraceAnalysis and its breakdowns) from traceinsight or HolisticTraceAnalysis; the
    calling test is skipped, naming both, where neither is installed. One that is installed but fails to import
    (a dependency missing: it is installed with --no-deps) fails the test rather than skipping it."""
    if find_spec("hta") is None:
        pytest.skip(MISSING)
    return importlib.import_module("hta.trace_analysis")
