"""Exporters: turn the profiler's records into Prometheus metrics, OTel spans, traces and console text.

`build("console,prometheus,trace")` is the sinks of any training loop in one argument:
`profiler.Profiler(run_dir, exporters=exporters.build("console,prometheus,trace"))`. It returns a function of the
Profiler, which calls it when the run starts, so each sink takes the run directory, rank and role from the
Profiler and the profiler imports nothing of ours. It is the one place sinks are made: dflash-train calls the
same function with its own settings (dflash/telemetry.py). docs/API.md says what each sink writes.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

SINKS = ("console", "prometheus", "trace", "otel", "tensorboard", "wandb")
"""The sink names `build` takes."""
LIBRARIES = {"tensorboard": ("tensorboard", "pip install tensorboard (or the package's [tensorboard] extra)"),
             "wandb": ("wandb", "pip install wandb (or the package's [wandb] extra)")}
"""{sink: (the module it needs that the package does not install, how to get it)}."""


def missing_library(name: str) -> str | None:
    """Why sink `name` cannot be made here (its library is not installed, and how to install it), or None."""
    import importlib.util

    module, how = LIBRARIES.get(name, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"the {name} sink needs the {module} package, which is not installed: {how}"
DEFAULT_METRICS_PORT = 9464
"""The Prometheus port of rank 0 (rank R: this + R), dflash-train's default; a busy one is replaced by a free one."""


@dataclass(frozen=True)
class Owner:
    """What the sinks are made for: a Profiler has these attributes; dflash-train makes its sinks before its
    Profiler from one of these."""
    run_dir: Path
    rank: int
    role: str
    run_id: str | None = None
    """The run's unique id (OTel's dflash.run_id); None: the run directory's name."""


@dataclass(frozen=True)
class Served:
    """Where a rank's Prometheus endpoint answers: what a function given as `announce` is told."""
    rank: int
    role: str
    host: str
    port: int
    asked_port: int
    """The port asked for (0: any free one): another than `port` when it was busy."""

    @property
    def url(self) -> str:
        return f"http://{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}/metrics"


@dataclass(frozen=True)
class _Options:
    metrics_host: str
    metrics_port: int
    otlp_endpoint: str | None
    announce: object
    strict_port: bool
    port_offset: int | None
    keep_serving: bool
    console_run_end: bool


def otel_configured(env=os.environ) -> bool:
    """Whether the environment names an OTLP endpoint for `otel` (OTEL_EXPORTER_OTLP_ENDPOINT or its traces
    one)."""
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def build(spec: str = "console,prometheus,trace", *, metrics_host: str = "127.0.0.1",
          metrics_port: int = DEFAULT_METRICS_PORT, otlp_endpoint: str | None = None, announce=None,
          strict_port: bool = False, port_offset: int | None = None, keep_serving: bool = False,
          console_run_end: bool = True):
    """The exporters named in `spec` (comma-separated SINKS), in its order, as a function of the Profiler (or an
    `Owner`) that makes them: `console` (rank 0's interval summaries, and with console_run_end at the end the
    whole-run table and the report command), `prometheus` (an HTTP endpoint on metrics_host:metrics_port +
    port_offset, default + rank; a busy port replaced by a free one, or with strict_port refused as
    MetricsPortInUse; keep_serving: it answers after close until the process exits; where it serves goes to
    `announce`: a line on a text stream, default stderr, or a function given the `Served`), `trace`
    (RUN_DIR/trace/rank{R}.json for Perfetto), `otel` (OTLP/HTTP to otlp_endpoint, else to
    OTEL_EXPORTER_OTLP_ENDPOINT; none where OTEL_SDK_DISABLED is true), `tensorboard` (RUN_DIR/tensorboard/rank{R}/,
    exporters/tensorboard.py), `wandb` (one W&B run per rank under RUN_DIR/wandb/, offline unless WANDB_MODE or
    credentials say otherwise, exporters/wandb_run.py). ValueError now, before any run starts, for a name it does
    not know, a sink whose library is not installed (missing_library) or an `otel` with no endpoint. The endpoint is made first; a sink that fails to
    be made closes the ones made before it."""
    names = [n.strip() for n in spec.split(",") if n.strip()] if isinstance(spec, str) else None
    if names is None:
        raise ValueError(f"exporters.build: spec must be a string like 'console,prometheus,trace', got {spec!r}")
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"exporters.build: unknown sink {unknown[0]!r} in {spec!r} (known: {', '.join(SINKS)})")
    if isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 <= metrics_port <= 65535:
        raise ValueError(f"exporters.build: metrics_port must be a port number (0: any free port), "
                         f"got {metrics_port!r}")
    missing = next((why for n in names if (why := missing_library(n))), None)
    if missing:
        raise ValueError(f"exporters.build: {missing}")
    if "otel" in names and not (otlp_endpoint or otel_configured()):
        raise ValueError("exporters.build: 'otel' needs otlp_endpoint= or OTEL_EXPORTER_OTLP_ENDPOINT")
    options = _Options(metrics_host, metrics_port, otlp_endpoint, announce, strict_port, port_offset, keep_serving,
                       console_run_end)

    unique = list(dict.fromkeys(names))   # each once, in the order given

    def make(prof) -> list:
        made = {}
        try:
            # the endpoint first: a port it cannot have fails before any other sink starts its threads
            for name in sorted(unique, key=lambda n: n != "prometheus"):
                made[name] = _MAKERS[name](prof, options)
        except BaseException:
            for exporter in made.values():   # a later sink failed: release the ports and threads of the earlier ones
                if exporter is not None:
                    exporter.close(0.0)
            raise
        return [made[name] for name in unique if made[name] is not None]
    return make


def _console(prof, options):
    from exporters.console import ConsoleExporter

    if prof.rank != 0:
        return None
    return ConsoleExporter(run_dir=prof.run_dir if options.console_run_end else None)


def _prometheus(prof, options):
    from exporters.prometheus import PrometheusExporter

    host, base = options.metrics_host, options.metrics_port
    port = base + (prof.rank if options.port_offset is None else options.port_offset) if base else 0
    exporter = PrometheusExporter({"rank": prof.rank, "role": prof.role}, host=host, port=port,
                                  strict=options.strict_port, keep_serving=options.keep_serving)
    served = Served(prof.rank, prof.role, host, exporter.port, port)
    if callable(options.announce):
        options.announce(served)
    else:
        busy = f" (port {port} was busy)" if port and exporter.port != port else ""
        print(f"profiler: rank {prof.rank} ({prof.role}) serves Prometheus metrics at {served.url}{busy}",
              file=options.announce or sys.stderr, flush=True)
    return exporter


def _trace(prof, options):
    from exporters.trace import TraceExporter

    return TraceExporter(prof.run_dir, prof.rank)


def _otel(prof, options):
    from exporters import otel

    ids = {"rank": prof.rank, "role": prof.role,   # host: the machine's name
           "run_id": getattr(prof, "run_id", None) or Path(prof.run_dir).name}
    if options.otlp_endpoint:
        return otel.OtelExporter(options.otlp_endpoint, **ids)
    return otel.from_env(**ids)


def _tensorboard(prof, options):
    from exporters.tensorboard import TensorBoardExporter

    return TensorBoardExporter(prof.run_dir, prof.rank, prof.role, getattr(prof, "run_id", None))


def _wandb(prof, options):
    from exporters.wandb_run import WandbExporter

    return WandbExporter(prof.run_dir, prof.rank, prof.role, getattr(prof, "run_id", None))


_MAKERS = {"console": _console, "prometheus": _prometheus, "trace": _trace, "otel": _otel,
           "tensorboard": _tensorboard, "wandb": _wandb}
