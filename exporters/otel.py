"""OpenTelemetry exporter: run-log records in, OTel spans and metrics out over OTLP/HTTP.

Spans go to the SDK's BatchSpanProcessor and metrics to a PeriodicExportingMetricReader (their own threads),
so `export()` never waits on the network. Each `spans` record becomes one trace under a `profile.window` root.
Metrics are the fold's samples (exporters/fold.py) under OTel's semantic conventions (the catalog's `Otel` names:
dotted, no unit in the name, UCUM units; GPU memory, utilisation, power and temperature as `hw.*` with `hw.id` =
the GPU's UUID): a gauge is set, an up-down counter brought to the sample's level, a counter given the increase of
the sample's run total. Span time is a real histogram, `dflash.span.duration`: the run log carries per-interval
bucket counts, not durations, so each new sample's increase in counts is recorded as that many values inside
their buckets, placed so the sum is the spans' whole time (one SDK record per span that ended, on the exporter
thread); bucket bounds, counts and sum are the run log's (min and max are not recorded). A series the fold ends
(an expired p95) keeps its last value here: a synchronous instrument cannot withdraw one. The first failed export
logs one warning, the SDK's own export warnings held back meanwhile.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

from exporters.catalog import FAMILIES, Family
from exporters.fold import Buckets, Fold, Sample
from exporters.fold import clock_count as _clock_count  # noqa: F401 - tests/report reads the histogram count here
from profiler.schema import views
from profiler.stats import HISTOGRAM_BUCKETS_SECONDS

log = logging.getLogger("exporters")

SERVICE_NAME = "dflash-train"
ROOT_SPAN_NAME = "profile.window"
SPAN_QUEUE_SIZE = 32768          # a spans record holds up to profiler.detail.MAX_DETAIL_SPANS (20000)
# SDK loggers that report each failed export (and retries): held back while an exporter is open.
SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
               "opentelemetry.exporter.otlp.proto.http.metric_exporter",
               "opentelemetry.exporter.otlp.common.http",
               "opentelemetry.sdk._shared_internal",
               "opentelemetry.sdk.trace.export",
               "opentelemetry.sdk.metrics._internal.export")



def from_env(env: Mapping[str, str] = os.environ, **kwargs) -> "OtelExporter | None":
    """An OtelExporter (kwargs go to it) when an OTLP endpoint is set and OTEL_SDK_DISABLED is not "true";
    headers, certificates and compression the SDK reads from os.environ."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    base, traces = env.get("OTEL_EXPORTER_OTLP_ENDPOINT"), env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not (base or traces):
        return None
    if env.get("OTEL_METRIC_EXPORT_INTERVAL") and "metric_interval_s" not in kwargs:
        kwargs["metric_interval_s"] = float(env["OTEL_METRIC_EXPORT_INTERVAL"]) / 1e3
    return OtelExporter(base or None, traces_endpoint=traces or None,
                        metrics_endpoint=env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or None, **kwargs)


def _signal_url(endpoint, specific, path) -> str | None:
    """The signal's own URL, else base + /v1/<signal>, else None (the SDK resolves it from the environment)."""
    return specific or (f"{endpoint.rstrip('/')}/{path}" if endpoint else None)


class _SdkLogGate(logging.Filter):
    """Holds back the SDK export loggers' warnings, keeping the first not yet taken for the exporter's single
    warning to say why. Records with a traceback pass: the exporters here never raise, so one is a bug."""

    def __init__(self):
        super().__init__("dflash-otel-gate")
        self._lock = threading.Lock()
        self._held: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.exc_info:
            return True
        with self._lock:
            if self._held is None:
                message = record.getMessage()
                self._held = message if len(message) <= 300 else message[:300] + "..."
        return False

    def take(self) -> str | None:
        with self._lock:
            held, self._held = self._held, None
        return held

    def attach(self, on: bool) -> None:
        """Gate the SDK's export loggers (on) or let them speak again (off)."""
        for sdk_logger in map(logging.getLogger, SDK_LOGGERS):
            (sdk_logger.addFilter if on else sdk_logger.removeFilter)(self)


class _Counting:
    """An SDK span or metric exporter that reports (signal, items, ok) after every export."""

    def __init__(self, inner, signal: str, on_result):
        self._inner, self._signal, self._on_result = inner, signal, on_result

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def export(self, batch, *args, **kwargs):
        try:
            result = self._inner.export(batch, *args, **kwargs)
        except Exception:   # noqa: BLE001 - a backend error is a failed export, never a crash
            result = None
        items = len(batch) if self._signal == "traces" else sum(
            len(m.data.data_points) for rm in batch.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)
        self._on_result(self._signal, items, getattr(result, "name", None) == "SUCCESS")
        return result


def bucket_values(counts: list, bounds, total_s: float, max_s) -> list[tuple[float, int]]:
    """(value, times) pairs that fill histogram buckets exactly as `counts` says (one count per bound, plus
    +Inf), each value inside its bucket (bound before < value <= its bound; the +Inf bucket up to max_s), placed
    at one common fraction of every bucket's width so that the values sum to total_s where the buckets allow it."""
    top = max_s if max_s is not None and max_s > bounds[-1] else 2.0 * bounds[-1]
    edges = [0.0, *bounds, top]
    low = sum(c * edges[i] for i, c in enumerate(counts))
    high = sum(c * edges[i + 1] for i, c in enumerate(counts))
    t = 1.0 if high <= low else min(1.0, max(1e-6, (total_s - low) / (high - low)))
    return [(edges[i + 1] - (1.0 - t) * (edges[i + 1] - edges[i]), c) for i, c in enumerate(counts) if c]


def _attr(value):
    """An OTel attribute value: primitives and lists of them as they are, anything else as text."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return str(value)


def _attributes(pairs: dict) -> dict:
    return {k: _attr(v) for k, v in pairs.items() if v is not None}


class OtelExporter:
    """Run-log records -> OTel spans and metrics over OTLP/HTTP (see the module docstring)."""

    name = "otel"

    def __init__(self, endpoint: str | None = None, *, rank: int, role: str, run_id: str | None = None,
                 host: str | None = None, traces_endpoint: str | None = None, metrics_endpoint: str | None = None,
                 timeout_s: float = 2.0, metric_interval_s: float = 15.0,
                 span_exporter=None, metric_exporter=None, bucket_bounds_s=HISTOGRAM_BUCKETS_SECONDS):
        """endpoint: OTLP/HTTP base URL, overridden per signal by traces_/metrics_endpoint (None: the SDK's
        environment); span_exporter / metric_exporter replace the OTLP/HTTP ones; bucket_bounds_s: the span-time
        histogram's bounds, which a run_start must carry for its bucket counts to be exported."""
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._lock = threading.Lock()
        self._counts = collections.Counter()   # (signal, ok) -> spans or data points exported
        self._spans_made = self._spans_lost = 0
        self._failed = self._warned = self._closed = self._frozen = False
        self._gate = _SdkLogGate()
        self._host = host or socket.gethostname()
        self.endpoints = {"traces": _signal_url(endpoint, traces_endpoint, "v1/traces"),
                          "metrics": _signal_url(endpoint, metrics_endpoint, "v1/metrics")}
        span_exporter = span_exporter or OTLPSpanExporter(endpoint=self.endpoints["traces"], timeout=timeout_s)
        metric_exporter = metric_exporter or OTLPMetricExporter(endpoint=self.endpoints["metrics"],
                                                                timeout=timeout_s)
        resource = Resource.create(_attributes({
            "service.name": SERVICE_NAME, "dflash.rank": rank, "dflash.role": role, "host.name": self._host,
            "dflash.run_id": run_id, "service.instance.id": f"{run_id}/rank{rank}" if run_id else None}))
        self._tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._tracer_provider.add_span_processor(BatchSpanProcessor(
            _Counting(span_exporter, "traces", self._on_result), max_queue_size=SPAN_QUEUE_SIZE))
        self._tracer = self._tracer_provider.get_tracer("dflash.profiler")
        reader = PeriodicExportingMetricReader(
            _Counting(metric_exporter, "metrics", self._on_result),
            export_interval_millis=metric_interval_s * 1e3, export_timeout_millis=timeout_s * 1e3)
        self._bounds = tuple(float(b) for b in bucket_bounds_s)
        duration = FAMILIES["span_seconds"].otel.name
        self._meter_provider = MeterProvider(
            resource=resource, metric_readers=[reader], shutdown_on_exit=False,
            views=[View(instrument_name=duration, aggregation=ExplicitBucketHistogramAggregation(
                boundaries=self._bounds, record_min_max=False))])
        self._meter = self._meter_provider.get_meter("dflash.profiler")
        self._labels = {"rank": str(rank), "role": role, "host": self._host}
        self._instruments: dict = {}
        self._last: dict = {}            # (instrument, attributes) -> the last run total or level it was given
        self._other_bounds: set = set()  # histogram bounds unlike the view's, warned about once each
        self._fold = Fold()
        for sample in self._fold.opening(time.time()):
            self._apply(sample)
        self._gate.attach(True)

    # ---- failure accounting ----------------------------------------------------------------------
    def _on_result(self, signal: str, items: int, ok: bool) -> None:
        """Called by the SDK's export threads after every batch (spans) or collection (metrics)."""
        with self._lock:
            if self._frozen:
                return
            self._counts[signal, ok] += items
            self._failed = self._failed or not ok
        if ok:
            self._gate.take()   # a held message belonged to a retry that then succeeded
        else:
            self._warn_once(f"export of {signal} to {self.endpoints[signal] or 'the SDK default endpoint'} "
                            f"failed ({self._gate.take() or 'no reason given'})")

    def _warn_once(self, what: str) -> None:
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            log.warning("otel: %s; the run goes on, undelivered spans and metrics are counted as dropped "
                        "in stats(), no further warnings", what)

    def stats(self) -> dict:
        """{"exported", "dropped", "failed"}: items are spans plus metric data points."""
        with self._lock:
            ok = self._counts["traces", True] + self._counts["metrics", True]
            return {"exported": ok, "dropped": self._counts.total() - ok + self._spans_lost, "failed": self._failed}

    # ---- records ---------------------------------------------------------------------------------
    def export(self, record: dict) -> None:
        """Turn one run-log record into spans and metric updates; never blocks on the network."""
        if self._closed:
            return
        rec = views.view(record)
        if isinstance(rec, views.DetailWindow):
            self._export_spans(rec)
        for sample in self._fold(rec):   # the view made above: the fold takes it as it is
            self._apply(sample)

    def _export_spans(self, detail) -> None:
        """One trace per spans record (views.DetailWindow): a root window span, each raw span under its parent (or
        the root)."""
        from opentelemetry import trace
        from opentelemetry.context import Context

        entries = sorted((s for s in detail.spans if s.start_unix_ns is not None and s.end_unix_ns is not None),
                         key=lambda s: (s.start_unix_ns, s.depth or 0))
        if not entries:
            return
        first, last = (list(detail.steps or ()) + [None, None])[:2]
        window = {"dflash.step_first": first, "dflash.step_last": last}
        root = self._tracer.start_span(
            ROOT_SPAN_NAME, context=Context(), start_time=entries[0].start_unix_ns,
            attributes=_attributes({**window, "dflash.interval": detail.index, "dflash.spans_dropped": detail.dropped}))
        root_context = trace.set_span_in_context(root)
        contexts: dict = {}
        for s in entries:
            span = self._tracer.start_span(
                s.name or "span", context=contexts.get(s.parent, root_context),
                start_time=s.start_unix_ns, attributes=self._span_attributes(s, window))
            span.end(end_time=s.end_unix_ns)
            if s.id is not None:
                contexts[s.id] = trace.set_span_in_context(span)
        root.end(end_time=max(s.end_unix_ns for s in entries))
        with self._lock:
            self._spans_made += len(entries) + 1

    @staticmethod
    def _span_attributes(s, window: dict) -> dict:
        """A raw span's (views.RawSpan) attributes: its thread, ids, times, bytes and tags."""
        attrs = {"thread.name": s.thread, "thread.id": s.tid, "dflash.span_id": s.id,
                 "dflash.cpu_seconds": s.cpu_seconds, "dflash.gpu_seconds": s.gpu_seconds,
                 "dflash.bytes": s.bytes, **window}
        attrs.update({f"dflash.{k}": v for k, v in (s.attrs or {}).items()})
        return _attributes(attrs)

    # ---- metrics: the fold's samples ----------------------------------------------------------------
    def _instrument(self, family: Family):
        """The SDK instrument for a family's Otel spec (its own instrument, else the family's kind), made once."""
        spec = family.otel
        inst = self._instruments.get(spec.name)
        if inst is None:
            make = {"histogram": self._meter.create_histogram, "counter": self._meter.create_counter,
                    "updown": self._meter.create_up_down_counter}.get(spec.instrument or family.kind,
                                                                      self._meter.create_gauge)
            inst = self._instruments[spec.name] = make(spec.name, unit=spec.unit, description=family.help)
        return inst

    def _attrs(self, sample: Sample) -> dict:
        """The common labels, the conventions' fixed attributes, the sample's labels under their OTel keys and
        what the conventions say of the labelled thing (a GPU's hw.id and hw.name)."""
        spec = sample.family.otel
        keys = spec.labels or sample.family.labels
        return {**self._labels, **dict(spec.attributes), **{k: v for k, v in zip(keys, sample.labels) if k},
                **dict(sample.about)}

    def _apply(self, sample: Sample) -> None:
        """Set a gauge, bring an up-down counter to the sample's level, add a counter's increase since its last
        run total (all of it after a reset), record a histogram's new spans; families OTel does not carry and
        ended series are skipped."""
        family, value = sample.family, sample.value
        if family.otel is None or value is None:
            return
        inst, attrs = self._instrument(family), self._attrs(sample)
        ident, how = (family.otel.name, tuple(sorted(attrs.items()))), family.otel.instrument or family.kind
        if isinstance(value, Buckets):
            self._durations(inst, value, attrs, ident)
        elif how in ("counter", "updown"):
            last = self._last.get(ident, 0.0)
            self._last[ident] = value
            inst.add(value - last if how == "updown" or value >= last else value, attrs)
        else:
            inst.set(value, attrs)

    def _durations(self, histogram, b: Buckets, attrs: dict, ident: tuple) -> None:
        """The spans a histogram sample added since the last one into dflash.span.duration, bucket by bucket."""
        if b.bounds != self._bounds:
            if b.bounds not in self._other_bounds:
                self._other_bounds.add(b.bounds)
                log.warning("otel: the run log's histogram bounds %s differ from the exporter's %s: "
                            "dflash.span.duration is not exported for this run", list(b.bounds), list(self._bounds))
            return
        last = self._last.get(ident)
        self._last[ident] = b
        counts, sum_s = b.counts, b.sum_s
        if last is not None and all(n >= m for n, m in zip(b.counts, last.counts)):
            counts, sum_s = tuple(n - m for n, m in zip(b.counts, last.counts)), b.sum_s - last.sum_s
        if not any(counts):
            return
        for value, times in bucket_values(list(counts), self._bounds, sum_s, b.max_s):
            for _ in range(times):
                histogram.record(value, attrs)

    # ---- close -----------------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Flush and shut down both providers within timeout_s, then freeze stats() (unconfirmed spans: dropped)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s

        def close_spans():
            # BatchSpanProcessor ignores force_flush's timeout and shutdown takes none: a helper thread
            # waited on for a bounded time keeps the deadline.
            self._tracer_provider.force_flush(int(timeout_s * 500))
            self._tracer_provider.shutdown()

        def close_metrics():
            # The periodic reader's shutdown makes one last collection and export (the flush), within
            # its timeout; a separate force_flush would export the same cumulative points twice.
            self._meter_provider.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1e3)

        spans_done = self._run_bounded(close_spans, timeout_s / 2)
        metrics_done = self._run_bounded(close_metrics, deadline - time.monotonic())
        with self._lock:
            confirmed = self._counts["traces", True] + self._counts["traces", False]
            self._spans_lost, self._frozen = max(0, self._spans_made - confirmed), True
        if self._spans_lost or not (spans_done and metrics_done):
            self._warn_once(f"close did not finish within {timeout_s:.1f} s "
                            f"({self._spans_lost} spans unconfirmed)")
        if spans_done and metrics_done:
            self._gate.attach(False)   # else an SDK thread is still exporting: keep its lines held back

    def _run_bounded(self, fn, timeout_s: float) -> bool:
        """Run fn on a daemon thread for up to timeout_s; True when it finished."""
        def run():
            try:
                fn()
            except Exception as exc:   # noqa: BLE001 - a failing shutdown must not fail the run
                self._warn_once(f"shutdown failed ({exc!r})")

        thread = threading.Thread(target=run, name="dflash-otel-close", daemon=True)
        thread.start()
        thread.join(max(0.0, timeout_s))
        return not thread.is_alive()
