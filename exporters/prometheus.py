"""Prometheus: one HTTP endpoint per rank. `export(record)` applies the fold's samples (exporters/fold.py) to
plain values under a lock; a scrape turns them into families. Span-time histograms are the fold's run totals of
the intervals' fixed bucket counts, so `histogram_quantile` aggregates across ranks. Counters whose rate a window
needs (tokens, samples, steps, span seconds and counts, profiled seconds) move with every `tick` record and each
sample carries the tick's time (an explicit timestamp), so `rate()` over any window reads the run log's figure
for it whatever the scrape's phase; they exist at 0 from the first scrape, stamped with the exporter's start.
Every series carries `rank`, `role` and `host`, the process's `process_*` series (prometheus_client's
ProcessCollector) included; GPU series carry the GPU's `UUID`.

A rank's last records (a non-finite value, a hang, its run_end) matter most to alerts, and the rank may exit right
after them: `close()` waits, within its deadline, for one scrape to have read them, when something scrapes this
endpoint at all; with `keep_serving` the endpoint then answers with the final values until the process exits,
so a rank that finished before the others is not taken for a dead one.
"""
from __future__ import annotations

import errno
import itertools
import logging
import threading
import time

from exporters.catalog import COMMON_LABELS, FAMILIES, Family
from exporters.fold import Buckets, Fold, Sample

logger = logging.getLogger("exporters")


class MetricsPortInUse(OSError):
    """A port the user asked for is taken."""


class MetricsBindError(OSError):
    """The endpoint cannot be bound for a reason other than a busy port (an address of another machine, a name
    that does not resolve, a port below 1024); errno and strerror are the bind's."""


class MetricsState:
    """The value of every series, from the fold's samples. All access under `lock`."""

    def __init__(self, labels: dict):
        self.lock = threading.Lock()
        self.scraped = threading.Condition(self.lock)   # notified by every scrape answered
        self.folded = self.served = 0   # records folded so far; records folded when the last answered scrape read them
        self.scrapes = 0                # scrapes begun (close() waits only where something scrapes)
        self._request = threading.local()   # what the scrape this handler thread answers has read
        self.base = tuple(str(labels[k]) for k in COMMON_LABELS)
        self.families: dict = {}      # family name -> Family
        self.values: dict = {}        # family name -> {label values: float, or Buckets for a histogram}
        self.stamps: dict = {}        # family name -> {label values: Unix seconds the value describes}

    def collect(self):
        """The families at scrape time (a prometheus_client collector; auto_describe off: no describe)."""
        with self.lock:
            self._request.read = self.folded
            self.scrapes += 1   # counted as it begins: a close() racing the first answer still waits for it
            return list(_families(self))

    def request_done(self) -> None:
        """Called by the HTTP server once a request's response is sent: a scrape counts as served only then (a rank
        about to exit must not leave before the bytes are out)."""
        read, self._request.read = getattr(self._request, "read", None), None
        if read is not None:
            with self.lock:
                self.served = max(self.served, read)
                self.scraped.notify_all()

    def apply(self, sample: Sample) -> None:
        """One sample: the series' value and its stamp (exposed as the sample's timestamp), or, for None, no
        series any more."""
        name, labels = sample.family.name, sample.labels   # by name: a str's hash is kept, a Family's is not
        if sample.value is None:
            for table in (self.values, self.stamps):
                series = table.get(name, {})
                series.pop(labels, None)
                if not series:
                    table.pop(name, None)
            return
        self.families[name] = sample.family
        self.values.setdefault(name, {})[labels] = (sample.value if isinstance(sample.value, Buckets)
                                                    else float(sample.value))
        if sample.stamp_unix is not None:
            self.stamps.setdefault(name, {})[labels] = float(sample.stamp_unix)
        elif name in self.stamps:
            self.stamps[name].pop(labels, None)


class PrometheusExporter:
    """An exporter (profiler.export's contract: name, export, close) plus the HTTP endpoint it serves."""

    name = "prometheus"

    def __init__(self, labels: dict | None = None, host: str = "127.0.0.1", port: int = 0, strict: bool = True,
                 keep_serving: bool = False):
        """labels: the series' COMMON_LABELS, each defaulted (rank 0, role "main" as the Profiler's, host this
        machine's name); keep_serving: close() leaves the endpoint answering (a daemon thread) until the process
        exits."""
        import socket

        from prometheus_client import CollectorRegistry

        self.state = MetricsState({"rank": 0, "role": "main", "host": socket.gethostname(), **(labels or {})})
        self._fold = Fold()
        for sample in self._fold.opening(time.time()):
            self.state.apply(sample)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.state)
        self.registry.register(ProcessMetrics(self.state.base))
        self._keep_serving = keep_serving
        self._server = _serve(host, port, strict, self.registry, self.state.request_done)
        self.host, self.port = host, self._server.server_port

    # ---- exporter contract -----------------------------------------------------------------------
    def export(self, record: dict) -> None:
        samples = self._fold(record)   # the fold is this thread's alone: only applying them takes the lock
        with self.state.lock:
            for sample in samples:
                self.state.apply(sample)
            self.state.folded += 1

    def close(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for a scrape of the last record, if this endpoint is scraped at all; then stop
        serving, unless keep_serving."""
        with self.state.lock:
            if self.state.scrapes:
                self.state.scraped.wait_for(lambda: self.state.served >= self.state.folded, timeout=timeout_s)
        if not self._keep_serving:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop answering scrapes and release the port."""
        self._server.shutdown()
        self._server.server_close()


class ProcessMetrics:
    """prometheus_client's ProcessCollector (`process_*`: CPU seconds, resident and virtual memory, open fds,
    start time) with the rank's common labels added, plus the process's OS thread count; read at scrape time
    from /proc (Linux; elsewhere nothing)."""

    def __init__(self, base: tuple):
        from prometheus_client import ProcessCollector

        self._base = base
        self._inner = ProcessCollector(registry=None)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, Metric

        for family in self._inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                out.add_sample(sample.name, dict(zip(COMMON_LABELS, self._base), **sample.labels), sample.value)
            yield out
        threads = _os_threads()
        if threads is not None:
            fam = FAMILIES["process_threads"]
            mf = GaugeMetricFamily(fam.name, fam.help, labels=list(COMMON_LABELS))
            mf.add_metric(list(self._base), threads)
            yield mf


def _os_threads() -> int | None:
    """Threads of this process from /proc/self/status, None where there is no procfs."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Threads:")), None)
    except OSError:
        return None


MAX_CONNECTIONS = 16
"""Scrapes served at once; a connection beyond them is closed at once (the scraper retries next time)."""
READ_TIMEOUT_S = 5.0
"""A connection that sends no full request within this of connecting is closed, however it trickles its bytes (a
deadline for the whole request, not per recv): idle or slow connections cannot hold the slots."""


def _deadline_reader(sock, deadline_s: float):
    """The connection's request stream, each read given only what is left of a deadline deadline_s from now (a
    client sending a byte a second would reset a per-recv timeout forever)."""
    import io
    import socket
    import time
    deadline = time.monotonic() + deadline_s

    class DeadlineIO(socket.SocketIO):
        def readinto(self, b):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"no full request within {deadline_s:g} s")
            self._sock.settimeout(left_s)
            return super().readinto(b)
    return io.BufferedReader(DeadlineIO(sock, "rb"))


def _server_class(family, on_request_done):
    """A threading WSGI server with at most MAX_CONNECTIONS handler threads and a read timeout, quiet on a
    client's error (prometheus_client's own server starts a thread per connection and waits forever), calling
    on_request_done on the handler thread once a connection's requests are answered and it is closed."""
    import socketserver
    from wsgiref.simple_server import WSGIServer

    class BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
        address_family = family
        daemon_threads = True
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        def process_request(self, request, client_address):
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()
                on_request_done()

        def handle_error(self, request, client_address):
            pass   # a client that timed out or hung up: nothing to report
    return BoundedServer


def _start(host: str, port: int, registry, on_request_done):
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app

    class Handler(WSGIRequestHandler):
        timeout = READ_TIMEOUT_S

        def setup(self):
            super().setup()
            self.rfile = _deadline_reader(self.connection, READ_TIMEOUT_S)

        def log_message(self, format, *args):   # noqa: A002 - the base class's name
            pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = make_server(host, port, make_wsgi_app(registry), _server_class(family, on_request_done),
                         handler_class=Handler)
    threading.Thread(target=server.serve_forever, name="metrics.http", daemon=True).start()
    return server


def _serve(host: str, port: int, strict: bool, registry, on_request_done):
    """The endpoint's server on host:port; a busy port is MetricsPortInUse when strict, else a free port is
    taken instead (the caller announces it); any other failure to bind is MetricsBindError."""
    try:
        return _start(host, port, registry, on_request_done)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise MetricsBindError(exc.errno, exc.strerror or str(exc)) from exc
        if strict:
            raise MetricsPortInUse(exc.errno, f"port {port} on {host} is in use") from None
    try:
        return _start(host, 0, registry, on_request_done)
    except OSError as exc:
        raise MetricsBindError(exc.errno, exc.strerror or str(exc)) from exc


# ---- the families a scrape reads ---------------------------------------------------------------------
def _families(st: MetricsState):
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                        InfoMetricFamily)

    base_names = list(COMMON_LABELS)
    # every histogram family is served, before its first sample too
    histograms = {f.name: (f, {}) for f in FAMILIES.values() if f.kind == "histogram"}
    for name, series in st.values.items():
        family = st.families[name]
        if family.kind == "histogram":
            histograms[name] = (family, series)
            continue
        if family.kind == "info":
            mf = InfoMetricFamily(family.name[:-len("_info")], family.help, labels=base_names)
            for labels in series:
                mf.add_metric(list(st.base), dict(zip(family.labels, labels)))
            yield mf
            continue
        cls = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
        mf = cls(family.name, family.help, labels=base_names + list(family.labels))
        stamps = st.stamps.get(name, {})
        for labels, value in series.items():
            mf.add_metric(list(st.base + labels), value, timestamp=stamps.get(labels))
        yield mf
    for family, series in histograms.values():
        yield _histogram(family, series, st.base, HistogramMetricFamily)


def _histogram(family: Family, series: dict, base: tuple, cls):
    """One histogram family: each series' cumulative buckets, `le` in Prometheus' float format (1 -> "1.0")."""
    mf = cls(family.name, family.help, labels=list(COMMON_LABELS) + list(family.labels))
    for labels, b in series.items():
        les = [repr(float(bound)) for bound in b.bounds] + ["+Inf"]
        mf.add_metric(list(base + labels), list(zip(les, itertools.accumulate(b.counts))), b.sum_s)
    return mf
