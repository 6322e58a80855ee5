"""Exporters: turn the profiler's records into Prometheus metrics, OTel spans, traces and console text.

`build("console,prometheus,trace")` is the sinks of any training loop in one argument:
`profiler.Profiler(run_dir, exporters=exporters.build("console,prometheus,trace"))`. It returns a function of the
Profiler, which calls it when the run starts, so each sink takes the run directory, rank and role from the
Profiler and the profiler imports nothing of ours. docs/API.md says what each sink writes.
"""
from __future__ import annotations

import os
import sys

SINKS = ("console", "prometheus", "trace", "otel")
"""The sink names `build` takes."""
DEFAULT_METRICS_PORT = 9464
"""The Prometheus port of rank 0 (rank R: this + R), dflash-train's default; a busy one is replaced by a free one."""


def build(spec: str = "console,prometheus,trace", *, metrics_host: str = "127.0.0.1",
          metrics_port: int = DEFAULT_METRICS_PORT, otlp_endpoint: str | None = None, announce=None):
    """The exporters named in `spec` (comma-separated SINKS), as a function of the Profiler that makes them at its
    start: `console` (rank 0's interval summaries, and at the end the whole-run table and the report command),
    `prometheus` (an HTTP endpoint on metrics_host:metrics_port + rank, its URL printed to `announce`, default
    stderr), `trace` (RUN_DIR/trace/rank{R}.json for Perfetto), `otel` (OTLP/HTTP to otlp_endpoint, else to
    OTEL_EXPORTER_OTLP_ENDPOINT). ValueError now, before any run starts, for a name it does not know or an
    `otel` with no endpoint."""
    names = [n.strip() for n in spec.split(",") if n.strip()] if isinstance(spec, str) else None
    if names is None:
        raise ValueError(f"exporters.build: spec must be a string like 'console,prometheus,trace', got {spec!r}")
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"exporters.build: unknown sink {unknown[0]!r} in {spec!r} (known: {', '.join(SINKS)})")
    if isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535:
        raise ValueError(f"exporters.build: metrics_port must be a port number (0: any free port), "
                         f"got {metrics_port!r}")
    if "otel" in names and not (otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        raise ValueError("exporters.build: 'otel' needs otlp_endpoint= or OTEL_EXPORTER_OTLP_ENDPOINT")
    options = {"metrics_host": metrics_host, "metrics_port": metrics_port, "otlp_endpoint": otlp_endpoint,
               "announce": announce}

    def make(prof) -> list:
        made = []
        try:
            for name in dict.fromkeys(names):   # each once, in the order given
                exporter = _MAKERS[name](prof, options)
                if exporter is not None:
                    made.append(exporter)
        except BaseException:
            for exporter in made:   # a later sink failed: release the ports and threads of the earlier ones
                exporter.close(0.0)
            raise
        return made
    return make


def _console(prof, options):
    from exporters.console import ConsoleExporter

    return ConsoleExporter(run_dir=prof.run_dir) if prof.rank == 0 else None


def _prometheus(prof, options):
    from exporters.prometheus import PrometheusExporter

    host, base = options["metrics_host"], options["metrics_port"]
    port = base + prof.rank if base else 0
    exporter = PrometheusExporter({"rank": prof.rank, "role": prof.role}, host=host, port=port, strict=False)
    where = f"[{host}]" if ":" in host else host
    busy = f" (port {port} was busy)" if port and exporter.port != port else ""
    print(f"profiler: rank {prof.rank} ({prof.role}) serves Prometheus metrics at "
          f"http://{where}:{exporter.port}/metrics{busy}", file=options["announce"] or sys.stderr, flush=True)
    return exporter


def _trace(prof, options):
    from exporters.trace import TraceExporter

    return TraceExporter(prof.run_dir, prof.rank)


def _otel(prof, options):
    from exporters import otel

    ids = {"rank": prof.rank, "role": prof.role, "run_id": prof.run_dir.name}   # host: the machine's name
    if options["otlp_endpoint"]:
        return otel.OtelExporter(options["otlp_endpoint"], **ids)
    return otel.from_env(**ids)


_MAKERS = {"console": _console, "prometheus": _prometheus, "trace": _trace, "otel": _otel}
