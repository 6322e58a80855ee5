"""Prometheus: one HTTP endpoint per rank. `export(record)` folds each record into plain values under a lock; a
scrape turns them into families. Span-time histograms sum the intervals' fixed bucket counts, so
`histogram_quantile` aggregates across ranks. Counters whose rate a window needs (tokens, samples, steps, span
seconds and counts, profiled seconds) move with every `tick` record and each sample carries the tick's time
(an explicit timestamp), so `rate()` over any window reads the run log's figure for it whatever the scrape's phase;
they exist at 0 from the first scrape, stamped with the exporter's start. Every series carries `rank`, `role` and
`host`, the process's `process_*` series (prometheus_client's ProcessCollector) included; GPU series carry the
GPU's `UUID`.

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

from monitoring.catalog import ALLOCATOR_COUNTERS, ALLOCATOR_GAUGES, COMMON_LABELS, EVENT_KINDS, FAMILIES, \
    WAIT_SPANS, Family, gpu_gauges, gpu_labels, metric_name, train_metric_family, train_metric_value

logger = logging.getLogger("exporters")
_THROTTLE_REASONS = ("gpu_idle", "applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost",
                     "sw_thermal", "hw_thermal", "hw_power_brake", "display_clocks")


class MetricsPortInUse(OSError):
    """A port the user asked for is taken."""


class MetricsState:
    """Values of every family, folded from records. All access under `lock`."""

    def __init__(self, labels: dict):
        self.lock = threading.Lock()
        self.scraped = threading.Condition(self.lock)   # notified by every scrape answered
        self.folded = self.served = 0   # records folded so far; records folded when the last answered scrape read them
        self.scrapes = 0                # scrapes begun (close() waits only where something scrapes)
        self._request = threading.local()   # what the scrape this handler thread answers has read
        self.base = tuple(str(labels[k]) for k in COMMON_LABELS)
        self.values: dict = {}        # family key or dynamic Family -> {extra label values: value}
        self.stamps: dict = {}        # the same keys -> Unix seconds a value describes (tick-fed counters only)
        self.profiled_base_s = 0.0    # profiled seconds of earlier segments (a resume)
        self.segment_start_s: float | None = None   # the segment's start on its interval clock (run_start "t_s")
        self.histograms: dict = {}    # (span, clock) -> [cumulative bucket counts, sum seconds]
        self.bounds: list = []
        self.info: dict | None = None
        self.set("intervals", 0)   # counters present at 0 before anything happens, for dashboards and alerts
        for key in TICK_COUNTERS:     # stamped: a tick written before a scrape but folded after it is still newer
            self.set(key, 0, stamp=time.time())
        for kind in EVENT_KINDS:
            self.set("events", 0, kind)

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

    def set(self, family, value, *extra, add: bool = False, stamp: float | None = None) -> None:
        """One series' value; `stamp`: the Unix seconds it describes (exposed as the sample's timestamp)."""
        if value is not None:
            series, key = self.values.setdefault(family, {}), tuple(str(e) for e in extra)
            series[key] = float(value) + (series.get(key, 0.0) if add else 0.0)
            if stamp is not None:
                self.stamps.setdefault(family, {})[key] = float(stamp)


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
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.state)
        self.registry.register(ProcessMetrics(self.state.base))
        self._keep_serving = keep_serving
        self._server = _serve(host, port, strict, self.registry, self.state.request_done)
        self.host, self.port = host, self._server.server_port

    # ---- exporter contract -----------------------------------------------------------------------
    def export(self, record: dict) -> None:
        fold = _FOLDERS.get(record.get("type"))
        with self.state.lock:
            if fold is not None:
                fold(self.state, record)
            self.state.set("heartbeat", record.get("time_unix"))
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
    taken instead (the caller announces it)."""
    try:
        return _start(host, port, registry, on_request_done)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        if strict:
            raise MetricsPortInUse(exc.errno, f"port {port} on {host} is in use") from None
        return _start(host, 0, registry, on_request_done)


# ---- folding records into values (on the exporter thread) -------------------------------------------
TICK_COUNTERS = ("tokens", "samples", "steps", "profiled_seconds")
"""Counters folded from ticks that every rank serves from its first scrape (at 0)."""


def _fold_run_start(st: MetricsState, rec: dict) -> None:
    st.values.pop("run_end", None)   # a resumed segment runs again
    st.profiled_base_s = st.values.get("profiled_seconds", {}).get((), 0.0)
    st.segment_start_s = rec.get("t_s")
    st.bounds = list(rec.get("histogram_buckets_seconds") or [])
    info = {label: rec.get(label) or "unknown" for label in FAMILIES["build_info"].labels}
    st.info = dict(info, schema=str(rec.get("schema", 0)))


def _fold_interval(st: MetricsState, rec: dict) -> None:
    st.set("intervals", 1, add=True)
    st.set("step", rec.get("step"))
    st.set("profiler_cpu", rec.get("profiler_share"))
    duration = rec.get("duration_seconds") or 0.0
    st.set("profiler_cpu_seconds", (rec.get("profiler_share") or 0.0) * duration, add=True)
    for thread, seconds in (rec.get("threads_cpu_seconds") or {}).items():
        st.set("thread_cpu", seconds, thread, add=True)
    _fold_spans(st, rec.get("spans") or {}, rec.get("role"), rec.get("time_unix"))
    _fold_counters(st, rec.get("counters") or {})
    for name, g in (rec.get("gauges") or {}).items():
        fam = name if name in FAMILIES else Family(name, metric_name(name), "gauge", f"profiler gauge {name}",
                                                   ("stat",))
        for stat in ("last", "mean", "max"):
            st.set(fam, g.get(stat), stat)
    for name, m in (rec.get("metrics") or {}).items():
        found = train_metric_family(name)
        if found is not None:
            fam, extra = found
            st.set(fam.key, train_metric_value(name, m), *extra.values())
    _fold_memory(st, rec.get("memory") or {})
    for exporter, s in (rec.get("exporters") or {}).items():
        st.set("exporter_dropped", s.get("dropped", 0), exporter)


P95_KEPT_S = 300.0
"""How long a span's exact p95 outlives the interval it describes: Prometheus' default lookback (an instant query
finds no older sample), and well inside the head block's bounds (an older stamp would be refused at every scrape)."""


def _expire_p95(st: MetricsState, now_unix: float | None) -> None:
    """Drop each span's kept exact p95 whose interval ended more than P95_KEPT_S before `now_unix`."""
    stamps = st.stamps.get("span_p95", {})
    old = [key for key, stamp in stamps.items() if now_unix is not None and stamp < now_unix - P95_KEPT_S]
    for key in old:
        stamps.pop(key)
        st.values.get("span_p95", {}).pop(key, None)


def _fold_spans(st: MetricsState, spans: dict, role, end_unix: float | None) -> None:
    """`end_unix`: the interval's end. A span's exact p95 stays that of the last interval in which it ended any,
    stamped with that interval's end (the window it describes): the run's last intervals, an evaluation or the
    wind-down, leave the panel its last figure instead of none."""
    shares = st.values.get("span_share", {})
    for key in shares:
        shares[key] = 0.0    # a span that finished nothing this interval had no share of it
    _expire_p95(st, end_unix)
    for span, waiter in WAIT_SPANS.items():
        if waiter == role:
            st.set("wait_share", (spans.get(span) or {}).get("share") or 0.0, span)
    for name, e in spans.items():
        st.set("span_share", e.get("share"), name)
        for clock in ("cpu", "gpu"):
            stats = e.get(clock)
            if stats:
                st.set("span_p95", stats.get("p95_seconds"), name, clock, stamp=end_unix)
            if stats and stats.get("buckets") and len(stats["buckets"]) == len(st.bounds) + 1:
                h = st.histograms.setdefault((name, clock), [[0] * len(stats["buckets"]), 0.0])
                h[0] = [a + b for a, b in zip(h[0], stats["buckets"])]
                h[1] += stats.get("total_seconds") or 0.0
        if e.get("bytes") is not None:
            st.set("span_bytes", e["bytes"], name, add=True)
            st.set("span_bandwidth", e.get("bandwidth_bytes_per_s"), name)
            st.set("span_floor", e.get("floor_bytes_per_s"), name, e.get("floor"))
            st.set("span_floor_ratio", e.get("floor_ratio"), name)


def _counter_family(name: str):
    """A profiler counter's family: the catalog's, or one made for a loop's own counter."""
    known = name in FAMILIES and FAMILIES[name].kind == "counter"
    return name if known else Family(name, metric_name(name, kind="counter"), "counter", f"profiler counter {name}")


_TICK_SPAN_KEYS = {"cpu": ("cpu_seconds", "self_seconds", "count"),
                   "gpu": ("gpu_seconds", "gpu_self_seconds", "gpu_count")}


def _fold_tick(st: MetricsState, rec: dict) -> None:
    """The run totals a tick holds, each sample stamped with the instant the tick describes."""
    stamp = rec.get("time_unix")
    for name, value in (rec.get("counters") or {}).items():
        st.set(_counter_family(name), value, stamp=stamp)
    for name, e in (rec.get("spans") or {}).items():
        for clock, keys in _TICK_SPAN_KEYS.items():
            if keys[0] in e:   # the GPU's only where a CUDA pair was timed
                for family, key in zip(("span_time", "span_self_time", "span_count"), keys):
                    st.set(family, e.get(key), name, clock, stamp=stamp)
    t_s = rec.get("t_s")
    if st.segment_start_s is not None and t_s is not None:
        st.set("profiled_seconds", st.profiled_base_s + max(0.0, t_s - st.segment_start_s), stamp=stamp)


def _fold_counters(st: MetricsState, counters: dict) -> None:
    """An interval's counters: its tokens rate (the run totals come from ticks: _fold_tick)."""
    tokens = counters.get("tokens")
    if tokens is not None:
        st.set("tokens_rate", tokens.get("per_second"))


def _fold_memory(st: MetricsState, memory: dict) -> None:
    gpus = memory.get("gpus") or []
    for g in gpus:
        labels = gpu_labels(g)
        for key, value in gpu_gauges(g).items():
            st.set(key, value, *labels)
        if g.get("throttle_reasons") is not None:
            for reason in _THROTTLE_REASONS:
                st.set("gpu_throttle", float(reason in g["throttle_reasons"]), *labels, reason)
    alloc = memory.get("allocator") or {}
    if alloc.get("available"):
        labels = gpu_labels(gpus[0]) if gpus else ("0", "")
        for key, field in ALLOCATOR_GAUGES + ALLOCATOR_COUNTERS:
            st.set(key, alloc.get(field), *labels)


def _fold_event(st: MetricsState, rec: dict) -> None:
    st.set("events", 1, rec.get("kind"), add=True)


def _fold_run_end(st: MetricsState, rec: dict) -> None:
    st.set("run_end", rec.get("time_unix"), rec.get("status") or "unknown")


_FOLDERS = {"run_start": _fold_run_start, "interval": _fold_interval, "tick": _fold_tick, "event": _fold_event,
            "run_end": _fold_run_end}


def _families(st: MetricsState):
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                        InfoMetricFamily)

    base_names = list(COMMON_LABELS)
    for key, series in st.values.items():
        fam = FAMILIES[key] if isinstance(key, str) else key
        cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
        mf = cls(fam.name, fam.help, labels=base_names + list(fam.labels))
        stamps = st.stamps.get(key, {})
        for extra, value in series.items():
            mf.add_metric(list(st.base + extra), value, timestamp=stamps.get(extra))
        yield mf
    hist = FAMILIES["span_seconds"]
    mf = HistogramMetricFamily(hist.name, hist.help, labels=base_names + list(hist.labels))
    les = [repr(float(b)) for b in st.bounds] + ["+Inf"]     # Prometheus' float format: 1 -> "1.0"
    for (span, clock), (counts, total) in st.histograms.items():
        mf.add_metric(list(st.base) + [span, clock], list(zip(les, itertools.accumulate(counts))), total)
    yield mf
    if st.info is not None:
        info = FAMILIES["build_info"]
        mf = InfoMetricFamily(info.name[:-len("_info")], info.help, labels=base_names)
        mf.add_metric(list(st.base), st.info)
        yield mf

