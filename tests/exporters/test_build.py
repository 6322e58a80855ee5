"""exporters.build, the sinks of any loop in one argument (issue 37): names checked before any run starts, each
sink made from the Profiler's own run directory, rank and role when the run starts, the Prometheus URL
announced (a busy port replaced), the console on rank 0 only, and what a later sink's failure leaves behind."""
import io
import json
import os
import socket
import time
import urllib.request

import pytest

import exporters
import profiler
from exporters.console import ConsoleExporter
from exporters.prometheus import PrometheusExporter
from exporters.trace import TraceExporter
from tests.profiler.build import make_profiler


def test_a_bad_spec_is_refused_before_any_run_starts(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    with pytest.raises(ValueError, match=r"unknown sink 'prom' in 'console,prom' \(known: console, prometheus"):
        exporters.build("console,prom")
    with pytest.raises(ValueError, match="'otel' needs otlp_endpoint= or OTEL_EXPORTER_OTLP_ENDPOINT"):
        exporters.build("trace,otel")
    with pytest.raises(ValueError, match="metrics_port must be a port number"):
        exporters.build("prometheus", metrics_port=70000)
    with pytest.raises(ValueError, match="spec must be a string"):
        exporters.build(["console"])
    assert exporters.build(" , ")(None) == []   # nothing named: no sinks


class _Prof:
    """What a sink is made from: the Profiler's run_dir, rank and role."""

    def __init__(self, run_dir, rank=0, role="trainer"):
        self.run_dir, self.rank, self.role = run_dir, rank, role


def test_each_sink_takes_the_profilers_run_dir_rank_and_role(tmp_path):
    announced = io.StringIO()
    made = exporters.build("console,prometheus,trace,trace", metrics_port=0, announce=announced)(
        _Prof(tmp_path / "run", rank=2))
    try:
        assert [type(e) for e in made] == [PrometheusExporter, TraceExporter]   # console: rank 0 only; trace once
        prom, trace = made
        assert trace.path == tmp_path / "run" / "trace" / "rank2.json"
        assert announced.getvalue() == (f"profiler: rank 2 (trainer) serves Prometheus metrics at "
                                        f"http://127.0.0.1:{prom.port}/metrics\n")
        prom.export({"type": "event", "kind": "nonfinite", "time_unix": time.time()})
        text = urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics", timeout=5).read().decode()
        assert f'host="{socket.gethostname()}"' in text and 'rank="2"' in text and 'role="trainer"' in text
    finally:
        for e in made:
            e.close(0.0)
    (console,) = exporters.build("console")(_Prof(tmp_path / "run"))
    assert isinstance(console, ConsoleExporter) and console.run_dir == tmp_path / "run"


def test_a_busy_port_is_replaced_and_said(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        announced = io.StringIO()
        (prom,) = exporters.build("prometheus", metrics_port=port, announce=announced)(_Prof(tmp_path))
        try:
            assert prom.port != port
            assert f"at http://127.0.0.1:{prom.port}/metrics (port {port} was busy)" in announced.getvalue()
        finally:
            prom.close(0.0)


def test_a_failing_sink_releases_the_ones_made_before_it(tmp_path, monkeypatch):
    opened = []

    def prometheus(prof, options):
        opened.append(real_prometheus(prof, options))
        return opened[-1]

    def trace(prof, options):
        raise OSError("no room for the trace")

    real_prometheus = exporters._MAKERS["prometheus"]
    monkeypatch.setitem(exporters._MAKERS, "prometheus", prometheus)
    monkeypatch.setitem(exporters._MAKERS, "trace", trace)
    with pytest.raises(OSError, match="no room"):
        exporters.build("prometheus,trace", metrics_port=0, announce=io.StringIO())(_Prof(tmp_path))
    (prom,) = opened
    with pytest.raises(OSError):   # its endpoint is closed again: nothing answers on the port it held
        urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics", timeout=2)


def test_a_profiler_given_a_build_writes_through_its_sinks(tmp_path, capsys):
    run = tmp_path / "run"
    with make_profiler(run, role="trainer", interval_s=60, background=False, measure_floors=False,
                       exporters=exporters.build("console,trace", metrics_port=0)) as prof:
        prof.set_step(0)
        with profiler.span("trainer.step"):
            pass
        prof.set_step(1)
        prof.close_interval()
    out = capsys.readouterr().out
    assert "[profile] rank 0 trainer  interval 0  step 1 (" in out and "steps/s)" in out
    assert "whole run:" in out and f"dflash-report hotspots {run}" in out
    assert json.loads((run / "trace" / "rank0.json").read_text())["traceEvents"]


def test_otel_sends_a_loops_spans_to_the_endpoint_it_is_given(tmp_path, otlp_receiver_cls, monkeypatch):
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    receiver = otlp_receiver_cls()
    try:
        with make_profiler(tmp_path / "loop-7", role="trainer", rank=1, interval_s=60, background=False,
                           measure_floors=False, exporters=exporters.build("otel", otlp_endpoint=receiver.url)) as prof:
            prof.set_step(0)
            with profiler.span("trainer.step"):
                pass
            prof.set_step(1)
            prof.close_interval()
        spans = receiver.spans()
    finally:
        receiver.close()
    assert "trainer.step" in {s.name for _, s in spans}
    resource = spans[0][0]
    assert (resource["dflash.rank"].int_value, resource["dflash.role"].string_value) == (1, "trainer")
    assert resource["dflash.run_id"].string_value == "loop-7"
    assert resource["host.name"].string_value == socket.gethostname()


def test_a_refused_port_fails_before_any_other_sink_and_a_function_hears_where_it_serves(tmp_path, monkeypatch):
    """dflash-train's settings through the same build: a port it was given, refused when busy before the sinks
    listed ahead of the endpoint start; the endpoint on metrics_port + port_offset, told to a function; the console
    without the end-of-run table."""
    made = []

    def trace(prof, options):
        made.append("trace")
        return real_trace(prof, options)

    real_trace = exporters._MAKERS["trace"]
    monkeypatch.setitem(exporters._MAKERS, "trace", trace)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(exporters.prometheus.MetricsPortInUse):
            exporters.build("trace,prometheus", metrics_port=port - 1, port_offset=1, strict_port=True)(
                _Prof(tmp_path))
    assert made == []
    heard = []
    sinks = exporters.build("trace,console,prometheus", metrics_port=port - 1, port_offset=1, keep_serving=True,
                            console_run_end=False, announce=heard.append)(exporters.Owner(tmp_path, 0, "drafter"))
    try:
        assert [e.name for e in sinks] == ["trace", "console", "prometheus"] and sinks[1].run_dir is None
        assert heard == [exporters.Served(0, "drafter", "127.0.0.1", port, port)]
        assert heard[0].url == f"http://127.0.0.1:{port}/metrics"
    finally:
        sinks[-1].shutdown()
