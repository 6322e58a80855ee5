"""Every live sink keeps the exporter contract profiler/export.py's hub calls (OTel SpanExporter style):
a `name`, `export(record)` and `close(timeout_s)`; and none imports the offline report."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from exporters.console import ConsoleExporter
from exporters.otel import OtelExporter
from exporters.prometheus import PrometheusExporter
from exporters.trace import TraceExporter

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cls", [ConsoleExporter, OtelExporter, PrometheusExporter, TraceExporter])
def test_every_live_sink_has_name_export_and_close_with_a_timeout(cls):
    assert isinstance(cls.name, str) and cls.name
    assert list(inspect.signature(cls.export).parameters) == ["self", "record"]
    assert list(inspect.signature(cls.close).parameters) == ["self", "timeout_s"]


def _imported_packages(package: str) -> set:
    out = set()
    for path in (REPO / package).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package, allowed", [("exporters", {"exporters", "monitoring", "profiler"}),
                                              ("report", {"report", "monitoring", "profiler"}),
                                              ("monitoring", {"monitoring", "profiler"})])
def test_imports_run_one_way(package, allowed):
    ours = {"dflash", "profiler", "exporters", "report", "monitoring", "bench"}
    assert _imported_packages(package) & ours <= allowed
