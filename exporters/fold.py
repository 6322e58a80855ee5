"""One fold from run-log records to metric samples: what every live sink publishes, worked out once.

`Fold` turns each record of a rank (run_start, interval, tick, event, run_end) into `Sample`s of the catalog's
families (exporters/catalog.py); a sink maps them to its library and reads no record itself. A `spans` record
holds the detail window, not metrics: it only moves the heartbeat, as every record does.

- A gauge's value is its level now. A counter's is its run total: the fold adds up what records give per
  interval (intervals, events, profiler and thread CPU, span bytes) and passes on the totals ticks give (tokens,
  samples, steps, span time and counts, profiled seconds). A histogram's is a `Buckets` of run totals.
- `stamp_unix` is the instant a value describes where a record says so (a tick's time, the end of the interval
  of a span's exact p95): Prometheus exposes it as the sample's timestamp.
- A sample whose value is None ends its series: a p95 older than P95_KEPT_S, the run_end of a rank that starts
  another segment, build information a new run_start replaces, a memory forecast's series that the next
  forecast (or a new segment) no longer gives.
- Wait shares are the shares of the spans in which the record's role waits for the other side: the run_start's
  `span_table` (entries of kind "wait"), else profiler.schema.span_kinds.FALLBACK (logs written without a span table).
"""
from __future__ import annotations

from dataclasses import dataclass

from exporters.catalog import (ALLOCATOR_COUNTERS, ALLOCATOR_GAUGES, EVENT_KINDS, FAMILIES, INTERVAL_GAUGES,
                                MEMORY_FORECAST_FIELDS, NUMERICS_BOUNDS, NUMERICS_FIELDS, THROTTLE_REASONS, Family,
                                counter_family, gauge_family, gpu_about, gpu_gauges, gpu_labels,
                                train_metric_family, train_metric_value)
from profiler.schema import span_kinds, views, windows

P95_KEPT_S = 300.0
"""How long a span's exact p95 outlives the interval it describes: Prometheus' default lookback (an instant query
finds no older sample), and well inside the head block's bounds (an older stamp would be refused at every scrape)."""
TICK_COUNTERS = ("tokens", "samples", "steps", "profiled_seconds")
"""Counters fed by ticks that exist (at 0) before the first record, stamped with the sink's start."""
_TICK_SPAN_KEYS = {"cpu": ("cpu_seconds", "self_seconds", "count"),
                   "gpu": ("gpu_seconds", "gpu_self_seconds", "gpu_count")}
_TICK_SPAN_FAMILIES = ("span_time", "span_self_time", "span_count")
_NO_GPU = views.GpuMemory({"index": 0})
"""Whose labels the allocator's series carry when the interval lists no GPU (NVML unavailable)."""


@dataclass(frozen=True)
class Buckets:
    """A span histogram's run totals: whole spans per bucket (one count per bound, then +Inf; not cumulative
    across buckets), their whole seconds (mean times count, interval by interval) and the longest one seen."""
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float
    max_s: float | None = None


@dataclass(frozen=True)
class Sample:
    """One series' value: `labels` are the values of `family.labels`, in order; `about` what OTel's conventions
    say of the labelled thing besides them (a GPU's hw.id and hw.name)."""
    family: Family
    value: float | Buckets | None
    labels: tuple[str, ...] = ()
    stamp_unix: float | None = None
    about: tuple[tuple[str, str], ...] = ()


def clock_count(entry, clock: str) -> int:
    """Whole spans behind an interval span entry's (views.SpanEntry, or its dict) `clock` statistics: on the GPU
    only the GPU-timed ones."""
    e = views.SpanEntry.of(entry)
    if clock != "gpu":
        return e.count
    return e.gpu_count if e.gpu_count is not None else e.count - (e.gpu_unresolved or 0)


class Fold:
    """A rank's records in order -> samples (the module doc); one per sink, fed on the sink's thread."""

    def __init__(self):
        self._role: str | None = None
        self._wait_spans = span_kinds.FALLBACK.waits()
        self._bounds: tuple[float, ...] = ()
        self._totals: dict = {}        # (family key, labels) -> run total of a counter fed per interval
        self._histograms: dict = {}    # (span, clock) -> Buckets
        self._shared: dict = {}        # spans that have had a share (an ordered set)
        self._p95_stamps: dict = {}    # (span, clock) -> end of the interval its kept p95 describes
        self._profiled_s = self._profiled_base_s = 0.0
        self._segment_start_s: float | None = None
        self._ended: tuple | None = None    # labels of the run_end series, while there is one
        self._info: tuple | None = None     # labels of the build_info series
        self._peaks: dict = {}              # the segment's compute peaks (run_start), MFU's denominators
        self._forecast: tuple = ()          # (family key, labels) of each series the last memory forecast gave

    def opening(self, now_unix: float) -> list[Sample]:
        """The series every sink serves before any record, at 0: intervals, events of every EVENT_KINDS, and the
        tick counters stamped with `now_unix` (a tick written before a scrape but folded after it is newer)."""
        out = [self._add("intervals", 0)] + [self._add("events", 0, kind) for kind in EVENT_KINDS]
        return out + [Sample(FAMILIES[key], 0.0, stamp_unix=now_unix) for key in TICK_COUNTERS]

    def __call__(self, record) -> list[Sample]:
        """The samples one record (a dict of the run log, or its views.Record) gives, its heartbeat last."""
        rec = views.view(record)
        fold = next((f for kind, f in _BY_TYPE.items() if isinstance(rec, kind)), None)   # an event of any kind
        out = fold(self, rec) if fold is not None else []
        if rec.time_unix is not None:
            out.append(Sample(FAMILIES["heartbeat"], float(rec.time_unix)))
        return out

    def _add(self, key: str, amount: float, *labels: str) -> Sample:
        """A counter fed per interval: its run total after adding `amount`."""
        total = self._totals[key, labels] = self._totals.get((key, labels), 0.0) + float(amount)
        return Sample(FAMILIES[key], total, labels)

    # ---- run_start, run_end, event --------------------------------------------------------------------
    def _run_start(self, rec: views.RunStart) -> list[Sample]:
        """A segment begins: its histogram bounds, wait spans and role; a run_end before it is withdrawn."""
        out = [Sample(FAMILIES["run_end"], None, self._ended)] if self._ended is not None else []
        out += self._forecast_ends(())   # a forecast of the settings an earlier segment ran with
        self._ended = None
        self._profiled_base_s, self._segment_start_s = self._profiled_s, rec.t_s
        self._bounds = tuple(float(b) for b in rec.histogram_buckets_seconds or ())
        self._role = rec.role
        self._peaks = rec.compute_peaks
        self._wait_spans = span_kinds.of_run_start(rec.raw).waits()
        info = tuple(str(rec.schema or 0) if label == "schema" else str(getattr(rec, label) or "unknown")
                     for label in FAMILIES["build_info"].labels)
        if self._info not in (None, info):
            out.append(Sample(FAMILIES["build_info"], None, self._info))
        self._info = info
        return out + [Sample(FAMILIES["build_info"], 1.0, info)]

    def _run_end(self, rec: views.RunEnd) -> list[Sample]:
        if rec.time_unix is None:
            return []
        self._ended = (str(rec.status or "unknown"),)
        return [Sample(FAMILIES["run_end"], float(rec.time_unix), self._ended)]

    def _event(self, rec: views.Event) -> list[Sample]:
        return [self._add("events", 1, str(rec.kind))]

    def _memory_forecast(self, rec: views.MemoryForecast) -> list[Sample]:
        """The event's count, and each setting's forecast gauges (MEMORY_FORECAST_FIELDS) labelled by its flag
        and, on the need and limit, its limiting GPU; a figure the setting lacks (no largest where the run's value
        is not a number) is left out, and a series the last forecast gave that this one does not (a figure gone,
        another GPU limiting) ends."""
        out = self._event(rec)
        given = []
        for s in rec.settings:
            named = {"setting": str(s.flag), "limiting_gpu": str(s.gpu or "unknown")}
            for key, field in MEMORY_FORECAST_FIELDS:
                if (value := getattr(s, field)) is not None:
                    labels = tuple(named[label] for label in FAMILIES[key].labels)
                    given.append(Sample(FAMILIES[key], float(value), labels))
        return out + self._forecast_ends(given) + given

    def _forecast_ends(self, given) -> list[Sample]:
        """End each series of the last memory forecast that `given` (its successor's samples) does not have."""
        kept = dict.fromkeys((s.family.key, s.labels) for s in given)
        ended = [Sample(FAMILIES[key], None, labels) for key, labels in self._forecast if (key, labels) not in kept]
        self._forecast = tuple(kept)
        return ended

    # ---- tick: run totals, stamped with the tick's time -----------------------------------------------
    def _tick(self, rec: views.Tick) -> list[Sample]:
        stamp = rec.time_unix
        out = [Sample(counter_family(name), float(value), stamp_unix=stamp)
               for name, value in rec.counters.items() if value is not None]
        for name, e in rec.spans.items():
            for clock, keys in _TICK_SPAN_KEYS.items():
                if getattr(e, keys[0]) is not None:   # the GPU's only where a CUDA pair was timed
                    out += [Sample(FAMILIES[key], float(value), (name, clock), stamp)
                            for key, field in zip(_TICK_SPAN_FAMILIES, keys)
                            if (value := getattr(e, field)) is not None]
        t_s = rec.t_s
        if self._segment_start_s is not None and t_s is not None:
            self._profiled_s = self._profiled_base_s + max(0.0, t_s - self._segment_start_s)
            out.append(Sample(FAMILIES["profiled_seconds"], self._profiled_s, stamp_unix=stamp))
        return out

    # ---- interval ------------------------------------------------------------------------------------
    def _interval(self, rec: views.Interval) -> list[Sample]:
        out = [self._add("intervals", 1)]
        out += [Sample(FAMILIES[key], float(value)) for key, field in INTERVAL_GAUGES
                if (value := getattr(rec, field)) is not None]
        out.append(self._add("profiler_cpu_seconds", (rec.profiler_share or 0.0) * (rec.duration_seconds or 0.0)))
        out += [self._add("thread_cpu", seconds, thread)
                for thread, seconds in rec.threads_cpu_seconds.items() if seconds is not None]
        out += self._spans(rec.spans, rec.role or self._role, rec.time_unix)
        out += [Sample(FAMILIES[f"{name}_rate"], float(c.per_second)) for name, c in rec.counters.items()
                if f"{name}_rate" in FAMILIES and c.per_second is not None]
        out += self._mfu(rec.counters.get("model_flops"))
        out += [Sample(gauge_family(name), float(value), (stat,))
                for name, g in rec.gauges.items() for stat in ("last", "mean", "max")
                if (value := getattr(g, stat)) is not None]
        out += _train_metrics(rec.metrics)
        out += _numerics(rec.numerics)
        out += _memory(rec.memory)
        out += [Sample(FAMILIES["exporter_dropped"], float(s.dropped or 0), (name,))
                for name, s in rec.exporters.items()]
        return out

    def _mfu(self, flops) -> list[Sample]:
        """The segment's compute peaks and, where the interval counted model FLOPs (views.CounterStats), its MFU
        against each (windows.mfu)."""
        if flops is None or flops.per_second is None:
            return []
        peaks = {name: views.ComputePeak.of(p).flops_per_s for name, p in self._peaks.items()
                 if name in windows.mfu(1.0, {name: p})}
        out = [Sample(FAMILIES["peak_flops"], float(peak), (name,)) for name, peak in peaks.items() if peak is not None]
        return out + [Sample(FAMILIES["mfu"], ratio, (name,)) for name, ratio in
                      windows.mfu(float(flops.per_second), self._peaks).items()]

    def _spans(self, spans, role, end_unix: float | None) -> list[Sample]:
        """Shares (a span that had one and is absent had none of this interval), wait shares, exact p95s (each
        kept from the last interval in which the span ended any, stamped with its end: the run's last intervals,
        an evaluation or the wind-down, leave its last figure), histograms, bytes and bandwidth."""
        out = self._expire_p95(end_unix)
        shares = {name: e.share for name, e in spans.items()}
        out += [Sample(FAMILIES["span_share"], 0.0, (name,)) for name in self._shared if shares.get(name) is None]
        out += [Sample(FAMILIES["wait_share"], float(shares.get(span) or 0.0), (span,))
                for span, waiter in self._wait_spans.items() if waiter == role]
        for name, e in spans.items():
            if e.share is not None:
                self._shared[name] = True
                out.append(Sample(FAMILIES["span_share"], float(e.share), (name,)))
            for clock in ("cpu", "gpu"):
                out += self._clock_stats(name, clock, e, end_unix)
            out += _bytes_moved(name, e, self._add)
        return out

    def _clock_stats(self, name: str, clock: str, e, end_unix: float | None) -> list[Sample]:
        stats, out = getattr(e, clock), []
        if stats is None or not stats.raw:
            return out
        if stats.p95_seconds is not None:
            self._p95_stamps[name, clock] = end_unix
            out.append(Sample(FAMILIES["span_p95"], float(stats.p95_seconds), (name, clock), end_unix))
        buckets = stats.buckets
        if buckets and len(buckets) == len(self._bounds) + 1:
            kept = self._histograms.get((name, clock))
            if kept is None or kept.bounds != self._bounds:
                kept = Buckets(self._bounds, (0,) * len(buckets), 0.0)
            whole_s = (stats.mean_seconds or 0.0) * clock_count(e, clock)
            longest = max((m for m in (kept.max_s, stats.max_seconds) if m is not None), default=None)
            kept = self._histograms[name, clock] = Buckets(
                self._bounds, tuple(a + b for a, b in zip(kept.counts, buckets)), kept.sum_s + whole_s, longest)
            out.append(Sample(FAMILIES["span_seconds"], kept, (name, clock)))
        return out

    def _expire_p95(self, now_unix: float | None) -> list[Sample]:
        """End each kept exact p95 whose interval ended more than P95_KEPT_S before `now_unix`."""
        old = [key for key, stamp in self._p95_stamps.items()
               if now_unix is not None and stamp is not None and stamp < now_unix - P95_KEPT_S]
        for key in old:
            del self._p95_stamps[key]
        return [Sample(FAMILIES["span_p95"], None, key) for key in old]


def _bytes_moved(name: str, e, add) -> list[Sample]:
    """A byte-moving span's (views.SpanEntry) bytes (a run total, through `add`), bandwidth, and its floor where
    one is known."""
    out = []
    if e.bytes is not None:
        out.append(add("span_bytes", e.bytes, name))
        out += [Sample(FAMILIES[key], float(value), (name,))
                for key, value in (("span_bandwidth", e.bandwidth_bytes_per_s), ("span_floor_ratio", e.floor_ratio))
                if value is not None]
    if e.floor and e.floor_bytes_per_s is not None:
        out.append(Sample(FAMILIES["span_floor"], float(e.floor_bytes_per_s), (name, e.floor)))
    return out


def _train_metrics(metrics) -> list[Sample]:
    """The training scalars the catalog names; one the interval recorded as non-finite (null, with a reason in
    the run log) is NaN, never the last finite value."""
    out = []
    for name, stats in metrics.items():
        found = train_metric_family(name)
        if found is not None:
            value = train_metric_value(name, stats)
            out.append(Sample(found[0], float("nan") if value is None else float(value), tuple(found[1].values())))
    return out


def _numerics(numerics) -> list[Sample]:
    """Each stage's numerics gauges (views.Numerics: the interval's sampled steps), labelled by span and tensor; a
    figure the interval lacks (no finite sample) is left out, never the last one repeated."""
    out = []
    for e in numerics.stages.values():
        labels = (str(e.span), str(e.tensor))
        out += [Sample(FAMILIES[key], float(value), labels) for key, field in NUMERICS_FIELDS
                if (value := getattr(e, field)) is not None]
        out += [Sample(FAMILIES["numerics_out_of_range"], float(value), (*labels, bound))
                for bound, field in NUMERICS_BOUNDS if (value := getattr(e, field)) is not None]
    return out


def _memory(memory) -> list[Sample]:
    """Per-GPU gauges and throttle reasons (every reason, 0 or 1, where the GPU reports them), and the caching
    allocator's gauges and counts on the rank's own GPU (the interval's first), from a views.Memory."""
    out, gpus = [], memory.gpus or []
    for g in gpus:
        labels, about = gpu_labels(g), gpu_about(g)
        out += [Sample(FAMILIES[key], float(value), labels, about=about) for key, value in gpu_gauges(g).items()]
        if g.throttle_reasons is not None:
            out += [Sample(FAMILIES["gpu_throttle"], float(reason in g.throttle_reasons), (*labels, reason),
                           about=about) for reason in THROTTLE_REASONS]
    alloc = memory.allocator
    if alloc.available:
        own = gpus[0] if gpus else _NO_GPU
        out += [Sample(FAMILIES[key], float(value), gpu_labels(own), about=gpu_about(own))
                for key, field in ALLOCATOR_GAUGES + ALLOCATOR_COUNTERS if (value := getattr(alloc, field)) is not None]
    return out


_BY_TYPE = {views.RunStart: Fold._run_start, views.Interval: Fold._interval, views.Tick: Fold._tick,
            views.MemoryForecast: Fold._memory_forecast, views.Event: Fold._event, views.RunEnd: Fold._run_end}
