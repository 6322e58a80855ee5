"""Every live sink keeps the exporter contract profiler/export.py's hub calls (OTel SpanExporter style):
a `name`, `export(record)` and `close(timeout_s)` (tests/test_layering.py: none imports the offline report)."""
from __future__ import annotations

import inspect

import pytest

from exporters.console import ConsoleExporter
from exporters.otel import OtelExporter
from exporters.prometheus import PrometheusExporter
from exporters.trace import TraceExporter


@pytest.mark.parametrize("cls", [ConsoleExporter, OtelExporter, PrometheusExporter, TraceExporter])
def test_every_live_sink_has_name_export_and_close_with_a_timeout(cls):
    assert isinstance(cls.name, str) and cls.name
    assert list(inspect.signature(cls.export).parameters) == ["self", "record"]
    assert list(inspect.signature(cls.close).parameters) == ["self", "timeout_s"]
