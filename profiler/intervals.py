"""Interval aggregation, off the hot path (fed by profiler/collector.py).

Per span name and interval, two things differ for a span crossing a boundary:
- *Time* (the CPU `total_seconds`, and `share` without GPU time) is split across the intervals a span
  overlaps: at a close every open span is credited its wall time inside the interval (`open_cpu_seconds`),
  the rest goes where it ends; the pieces sum to its duration, so one thread's span never exceeds 100%.
- *Whole spans* (count, mean, percentiles, max, buckets, bytes, the detail window) see each span once, in the
  interval it is collected complete in (CPU part ended and, under CUDA, both events completed; unresolved
  pairs are carried whole). For `share` only, GPU time is capped at the host window the span can have run in
  within the interval: max(begin, interval start) .. min(seen resolved, interval end).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, fields

from profiler.cuda_timing import resolve
from profiler.detail import NullDetailWindow
from profiler.gpu_lag import NullGpuLag
from profiler.stats import RunStats, as_seconds, summarize


@dataclass(slots=True)
class _Bytes:
    """What the spans that gave bytes= moved, and their time: a bandwidth's parts."""
    bytes: int = 0            # bytes declared by spans that gave bytes=
    bytes_n: int = 0          # how many spans gave bytes=
    bytes_cpu: float = 0.0    # their CPU seconds
    bytes_gpu: float = 0.0    # their GPU seconds
    bytes_timed: int = 0      # bytes of the GPU-timed ones (the GPU bandwidth's numerator)


@dataclass(slots=True)
class _SpanAcc(_Bytes):
    """One span name's records in the current interval."""
    cpu: list = field(default_factory=list)       # seconds, one per span
    gpu: list = field(default_factory=list)       # seconds (CUDA spans only)
    threads: set = field(default_factory=set)
    gpu_windows: list = field(default_factory=list)   # (gpu seconds, begin ns, resolved ns) for the share's cap
    timed: int = 0            # spans that recorded CUDA events (resolved or not)
    gpu_self: float = 0.0     # their GPU seconds less their children's (self time)
    path: str | None = None   # the copy path the spans' tag named (`profiler.tag(path=...)`): picks the floor


@dataclass(slots=True)
class _RunSpan(_Bytes):
    cpu: RunStats = field(default_factory=RunStats)
    gpu: RunStats = field(default_factory=RunStats)
    time_ns: int = 0          # CPU time credited over the run (the intervals' split totals, summed)
    self_ns: int = 0          # the same less the children's time (self time)
    gpu_self: float = 0.0
    threads: set = field(default_factory=set)
    path: str | None = None


@dataclass(slots=True)
class _Split:
    """CPU time credited to one interval (the current one, or the next: time carried past a closing boundary)."""
    time_ns: dict = field(default_factory=dict)   # name -> ns credited (split time)
    self_ns: dict = field(default_factory=dict)   # name -> the same less the children's pieces (split self time)
    kids_ns: dict = field(default_factory=dict)   # span id -> its children's pieces credited here

    def add(self, name: str, span_id, parent_id, piece_ns: int) -> None:
        """Credit `piece_ns` of a span: its name's time, its self time (less its children's pieces so far), and
        its parent's children."""
        self.time_ns[name] = self.time_ns.get(name, 0) + piece_ns
        self.self_ns[name] = self.self_ns.get(name, 0) + max(0, piece_ns - self.kids_ns.pop(span_id, 0))
        if parent_id is not None:
            self.kids_ns[parent_id] = self.kids_ns.get(parent_id, 0) + piece_ns


class IntervalAggregator:
    """Accumulates drained records: `close_parts()` the interval's sections (and a reset), `run_parts()` the run's."""

    def __init__(self, floors: dict | None = None, floor_fn=None, is_cuda: bool = False, event_pool=None,
                 detail=None, gpu_lag=None, pending: list | None = None):
        self.floors = floors or {}
        self.gpu_lag = gpu_lag or NullGpuLag()   # places resolved pairs on the host timeline (profiler/gpu_lag.py)
        self.detail = detail or NullDetailWindow()   # sees every finished span (the `spans` record)
        self.floor_fn = floor_fn
        self.is_cuda = is_cuda
        self.event_pool = event_pool
        # (thread_name, CUDA SpanRecord) awaiting completion; changed in place: `detail` may read the same list
        self.pending: list = [] if pending is None else pending
        self._spans: dict = {}
        self._run_spans: dict = {}
        self._counters: dict = {}        # name -> interval total
        self._run_counters: dict = {}    # name -> run total
        self._gauges: dict = {}          # name -> [values]
        self._metrics: dict = {}         # name -> [values (floats or 0-dim tensors)]
        self._run_metrics: dict = {}     # name -> _MetricSum of the closed intervals' values (ticks' "metrics")
        self._now, self._carry = _Split(), _Split()   # the current interval's time; the next one's so far
        self._credited: dict = {}        # open span id -> boundary (perf_counter_ns) its time is credited up to
        self._kids_basis_s: dict = {}    # span id -> its finished children's whole seconds (GPU, else CPU)
        self._start_ns: int | None = None   # the current interval's start boundary (perf_counter_ns), once known

    # ---- feeding -------------------------------------------------------------------------------
    def add_drained(self, drained, boundary_ns: int | None = None) -> None:
        """Take SpanRecorder.drain()'s output (each span's CPU time credited now, whatever its GPU pair does),
        then resolve the complete CUDA pairs; with `boundary_ns` (a close), time past it goes to the next interval."""
        for thread_name, spans, misc in drained:
            if spans:
                self._add_finished(thread_name, spans, boundary_ns)
            for kind, name, value in misc:
                if kind == 0:
                    self._counters[name] = self._counters.get(name, 0) + value
                    self._run_counters[name] = self._run_counters.get(name, 0) + value
                elif kind == 1:
                    self._gauges.setdefault(name, []).append(value)
                else:
                    self._metrics.setdefault(name, []).append(value)
        self.gpu_lag.tick()
        if self.pending:
            self.resolve_pending()

    def _add_finished(self, thread_name: str, records: list, boundary_ns: int | None) -> None:
        """One thread's drained records: each credited, CUDA ones queued for their pair, CPU ones added whole."""
        cpu_records = []
        for rec in records:
            self._credit(rec.name, rec.id, rec.parent, rec.t0_ns, rec.t1_ns, boundary_ns)
            if rec.end_event is not None:   # a CUDA span: whole once its event pair resolved
                self.pending.append((thread_name, rec))
            else:
                cpu_records.append((thread_name, rec, None))
        self._add_whole(cpu_records, timed=False)

    def _credit(self, name: str, span_id, parent_id, t0_ns: int, t1_ns: int, boundary_ns: int | None) -> None:
        """A finished span's time since it was last credited (else its begin); with `boundary_ns` (a close),
        the part past it is carried."""
        start_ns = self._credited.pop(span_id, t0_ns)
        cut_ns = t1_ns if boundary_ns is None else min(t1_ns, max(start_ns, boundary_ns))
        self._now.add(name, span_id, parent_id, max(0, cut_ns - start_ns))
        if t1_ns > cut_ns:
            self._carry.add(name, span_id, parent_id, t1_ns - cut_ns)

    def _credit_open(self, boundary_ns: int | None, open_spans) -> dict:
        """Credit every span open at the boundary its time inside the interval (from its begin, or the boundary
        it was last credited up to), innermost first so a parent's self time leaves out its children's;
        {name: (ns, threads)} of those pieces. `open_spans`: open_spans(ids=True), outermost first per thread."""
        out: dict = {}
        credited: dict = {}
        if boundary_ns is None:
            return out
        for entry in open_spans:
            stack = entry["spans"]
            for i in range(len(stack) - 1, -1, -1):
                s = stack[i]
                if s["t0_ns"] >= boundary_ns:   # began after the boundary was read: nothing to credit yet
                    continue
                piece_ns = boundary_ns - self._credited.get(s["id"], s["t0_ns"])
                credited[s["id"]] = boundary_ns
                ns, threads = out.get(s["name"], (0, set()))
                out[s["name"]] = (ns + piece_ns, threads | {entry["thread"]})
                self._now.add(s["name"], s["id"], stack[i - 1]["id"] if i else None, piece_ns)
        self._credited = credited   # only spans open now; ended ones were popped when credited
        return out

    def resolve_pending(self) -> int:
        """Resolve completed CUDA pairs (non-blocking); returns how many are still pending."""
        done, self.pending[:] = resolve(self.pending, self.event_pool, self.gpu_lag.place)
        if done:   # the span clock: a resolved pair's GPU work ended before seen_ns
            self._add_whole(done, timed=True, seen_ns=time.perf_counter_ns())
        return len(self.pending)

    def _add_whole(self, done: list, timed: bool, seen_ns: int = 0) -> None:
        """Add whole spans, (thread_name, record, gpu_seconds or None), in one loop, and offer them to the detail
        window; `timed`: CUDA records (resolved, or at run end never resolved)."""
        spans = self._spans
        for thread_name, rec, gpu_s in done:
            name, t0, t1, nbytes = rec.name, rec.t0_ns, rec.t1_ns, rec.bytes
            acc = spans.get(name)
            if acc is None:
                acc = spans[name] = _SpanAcc()
            cpu_s = (t1 - t0) / 1e9
            acc.timed += timed
            acc.cpu.append(cpu_s)
            acc.threads.add(thread_name)
            kids_s = self._kids_basis_s.pop(rec.id, 0.0)
            parent = rec.parent
            if parent is not None:   # the parent's children, on their own clock (GPU when timed)
                self._kids_basis_s[parent] = self._kids_basis_s.get(parent, 0.0) + (cpu_s if gpu_s is None else gpu_s)
            if gpu_s is not None:
                acc.gpu.append(gpu_s)
                acc.gpu_self += max(0.0, gpu_s - kids_s)
                acc.gpu_windows.append((gpu_s, t0, seen_ns if seen_ns > t1 else t1))
            if nbytes is not None:
                acc.path = span_path(rec.attrs) or acc.path
                acc.bytes += nbytes
                acc.bytes_n += 1
                acc.bytes_cpu += cpu_s
                if gpu_s is not None:
                    acc.bytes_gpu += gpu_s
                    acc.bytes_timed += nbytes
        self.detail.offer(done)

    def add_unresolved(self) -> None:
        """At run end: the pairs still pending count CPU-only (their span's "gpu_unresolved" says how many)."""
        done = [(thread_name, rec, None) for thread_name, rec in self.pending]
        self.pending.clear()
        self._add_whole(done, timed=True)

    # ---- output --------------------------------------------------------------------------------
    def _span_entry(self, name, cpu, gpu, threads, acc, duration_s) -> dict:
        """One span name's entry from its CPU and GPU (None: none timed) summaries, whose counts become "count"
        and "gpu_count" (the spans timed); `acc` (_SpanAcc or _RunSpan) gives the bytes."""
        count, own_total = cpu.pop("count"), (gpu or cpu)["total_seconds"] or 0.0
        entry = {"count": count, "threads": sorted(threads), "cpu": cpu, "gpu": gpu,
                 "share": own_total / duration_s if duration_s > 0 else None}
        if gpu is not None:
            entry["gpu_count"] = gpu.pop("count")
        if acc.bytes_n > 0:
            nbytes = acc.bytes_timed if gpu is not None else acc.bytes
            t = acc.bytes_gpu if gpu is not None else acc.bytes_cpu
            bw = nbytes / t if t > 0 else None
            entry["bytes"] = acc.bytes
            entry["bandwidth_bytes_per_s"] = bw
            floor = self.floor_fn(name, self.floors, self.is_cuda, acc.path) if self.floor_fn else None
            if floor is not None:
                entry["floor"], entry["floor_bytes_per_s"] = floor[0], floor[1]
                entry["floor_ratio"] = bw / floor[1] if bw is not None and floor[1] > 0 else None
        return entry

    def close_parts(self, duration_s: float, boundary_ns: int | None = None, open_spans=()) -> dict:
        """The interval's "spans", "counters", "gauges", "metrics", and a reset. `boundary_ns` (perf_counter_ns)
        ends the interval in span time; `open_spans` (open_spans(ids=True) after the last drain) get their time
        inside it credited (module doc). Without a boundary only finished spans' time counts."""
        spans = self._close_spans(duration_s, self._credit_open(boundary_ns, open_spans), boundary_ns)
        add_gpu_lag(spans, self.gpu_lag.take())
        self._start_ns = boundary_ns
        counters = {name: {"total": total, "per_second": total / duration_s if duration_s > 0 else None,
                           "run_total": self._run_counters[name]}
                    for name, total in self._counters.items()}
        gauge_floats, metric_floats = to_floats_by_name(self._gauges, self._metrics)
        gauges = {name: {"last": v[-1], "mean": sum(v) / len(v), "max": max(v)} for name, v in gauge_floats.items()}
        metrics = {name: {"last": v[-1], "mean": sum(v) / len(v)} for name, v in metric_floats.items()}
        for name, v in metric_floats.items():
            self._run_metrics.setdefault(name, _MetricSum()).add(v)
        self._counters, self._gauges, self._metrics = {}, {}, {}
        return {"spans": spans, "counters": counters, "gauges": gauges, "metrics": metrics}

    def _close_spans(self, duration_s: float, open_pieces: dict, boundary_ns: int | None = None) -> dict:
        """Entries of every span name that finished or held time in the interval, folded into the run's; the next
        interval starts with the time carried past the boundary."""
        spans = {}
        now = self._now
        for name in [*self._spans, *(n for n in now.time_ns if n not in self._spans)]:
            acc = self._spans.get(name) or _SpanAcc()
            time_ns, self_ns = now.time_ns.get(name, 0), now.self_ns.get(name, 0)
            open_ns, open_threads = open_pieces.get(name, (0, set()))
            if not acc.cpu and time_ns == 0:
                continue
            run = self._run_spans.setdefault(name, _RunSpan())
            cpu_s, gpu_s = as_seconds(acc.cpu), as_seconds(acc.gpu)   # one array each, for both uses below
            run.cpu.add(cpu_s)
            run.gpu.add(gpu_s)
            run.threads |= acc.threads | open_threads
            for f in fields(_Bytes):
                setattr(run, f.name, getattr(run, f.name) + getattr(acc, f.name))
            run.time_ns += time_ns
            run.self_ns += self_ns
            run.gpu_self += acc.gpu_self
            run.path = acc.path or run.path
            cpu = summarize(cpu_s, buckets=True)
            cpu["total_seconds"] = time_ns / 1e9   # split time; the rest of the block is whole spans
            cpu["self_seconds"] = self_ns / 1e9
            gpu = summarize(gpu_s, buckets=True) if acc.gpu else None
            if gpu is not None:
                gpu["self_seconds"] = acc.gpu_self
            entry = self._span_entry(name, cpu, gpu, acc.threads | open_threads, acc, duration_s)
            entry["open_cpu_seconds"] = open_ns / 1e9
            if entry["gpu"] is not None and duration_s > 0:   # each span's GPU time capped at its host window
                # and, together, at the interval per thread: one thread's spans of a name run one after another on
                # its stream, so their GPU windows are disjoint (a span resolved late would otherwise overlap the next)
                entry["share"] = min(self._gpu_share_seconds(acc.gpu_windows, boundary_ns),
                                     duration_s * max(1, len(acc.threads))) / duration_s
            if len(acc.gpu) < acc.timed:
                entry["gpu_unresolved"] = acc.timed - len(acc.gpu)
            spans[name] = entry
        self._spans, self._now, self._carry = {}, self._carry, _Split()
        self._prune_kids()
        return spans

    def _prune_kids(self) -> None:
        """Forget children's seconds noted for parents that finished first (a CUDA child resolved later): only
        pending records and open spans can still take them."""
        if len(self._kids_basis_s) > 4 * len(self.pending) + 1024:
            keep = {rec.id for _, rec in self.pending} | set(self._credited)
            self._kids_basis_s = {k: v for k, v in self._kids_basis_s.items() if k in keep}

    def _gpu_share_seconds(self, windows: list, boundary_ns: int | None) -> float:
        """GPU seconds for `share`, each span's capped at its host window in the interval (module doc)."""
        total = 0.0
        for gpu_s, t0_ns, seen_ns in windows:
            lo = t0_ns if self._start_ns is None else max(t0_ns, self._start_ns)
            hi = seen_ns if boundary_ns is None else min(seen_ns, boundary_ns)
            total += min(gpu_s, max(0, hi - lo) / 1e9)
        return total

    def tick_parts(self, boundary_ns: int | None = None, open_spans=()) -> dict:
        """A `tick` record's cumulative "spans" and "counters" at `boundary_ns` (docs/RUNLOG.md): the run's closed
        totals plus the current interval's so far, open spans credited up to the boundary by the same rule as a
        close, on a copy (the interval's own split is untouched). Without a boundary (right after a close) the
        closed totals alone: time carried past that close belongs to the next tick."""
        now = _Split()
        if boundary_ns is not None:
            saved_now, saved_credited = self._now, self._credited
            self._now = _Split(dict(saved_now.time_ns), dict(saved_now.self_ns), dict(saved_now.kids_ns))
            try:
                self._credit_open(boundary_ns, open_spans)
                now = self._now
            finally:
                self._now, self._credited = saved_now, saved_credited
        spans = {}
        for name in {*self._run_spans, *self._spans, *now.time_ns}:
            run, acc = self._run_spans.get(name) or _RunSpan(), self._spans.get(name) or _SpanAcc()
            entry = {"count": run.cpu.count + len(acc.cpu),
                     "cpu_seconds": (run.time_ns + now.time_ns.get(name, 0)) / 1e9,
                     "self_seconds": (run.self_ns + now.self_ns.get(name, 0)) / 1e9}
            gpu_count = run.gpu.count + len(acc.gpu)
            if gpu_count:
                entry.update(gpu_seconds=run.gpu.total + sum(acc.gpu), gpu_self_seconds=run.gpu_self + acc.gpu_self,
                             gpu_count=gpu_count)
            spans[name] = entry
        return {"spans": dict(sorted(spans.items())), "counters": dict(self._run_counters),
                "metrics": self._tick_metrics()}

    def _tick_metrics(self) -> dict:
        """A tick's cumulative "metrics": {name: {"sum", "count"[, "nonfinite"]}}, the closed intervals' plus the
        current interval's values so far. The current values are read to floats IN PLACE, so each 0-dim tensor
        is read once (the close then finds floats): on CUDA a deliberate device->host read, one per device per
        tick, on the collector thread (as a close does once per interval), never on the training loop."""
        self._metrics, = to_floats_by_name(self._metrics)
        out = {}
        for name in sorted({*self._run_metrics, *self._metrics}):
            total = (self._run_metrics.get(name) or _MetricSum()).plus(self._metrics.get(name) or [])
            out[name] = total.entry()
        return out

    def run_parts(self, duration_s: float) -> dict:
        """Whole-run "spans" (the interval shape; the CPU total sums the intervals' split time) and "counters"."""
        spans = {}
        for name, run in self._run_spans.items():
            cpu = run.cpu.summary()
            cpu["total_seconds"], cpu["self_seconds"] = run.time_ns / 1e9, run.self_ns / 1e9
            gpu = run.gpu.summary() if run.gpu.count else None
            if gpu is not None:
                gpu["self_seconds"] = run.gpu_self
            spans[name] = self._span_entry(name, cpu, gpu, run.threads, run, duration_s)
        counters = {name: {"total": total, "per_second": total / duration_s if duration_s > 0 else None}
                    for name, total in self._run_counters.items()}
        return {"spans": spans, "counters": counters}


class _MetricSum:
    """A metric's run totals: the finite values' sum and count, the non-finite ones counted apart (a NaN loss
    is written null in its interval's mean; here it must not make every later tick's sum NaN)."""

    def __init__(self, total: float = 0.0, count: int = 0, nonfinite: int = 0):
        self.total, self.count, self.nonfinite = total, count, nonfinite

    def add(self, values: list) -> None:
        for v in values:
            if math.isfinite(v):
                self.total += v
                self.count += 1
            else:
                self.nonfinite += 1

    def plus(self, values: list) -> "_MetricSum":
        out = _MetricSum(self.total, self.count, self.nonfinite)
        out.add(values)
        return out

    def entry(self) -> dict:
        out = {"sum": self.total, "count": self.count}
        if self.nonfinite:
            out["nonfinite"] = self.nonfinite
        return out


def span_path(attrs) -> str | None:
    """The copy path a span's attributes name (`profiler.tag(path="host")`), else None."""
    return attrs.get("path") if attrs else None


def add_gpu_lag(spans: dict, lags: dict) -> None:
    """Each span entry with samples placed in the interval gets its `gpu_lag` (profiler/gpu_lag.py)."""
    for name, lag in lags.items():
        if name in spans:
            spans[name]["gpu_lag"] = lag


def to_floats(values) -> list:
    """Python numbers as floats; one-element tensors, long after their steps finished, stacked per device and
    read with ONE .tolist(): on CUDA a deliberate device->host read, once per interval and device, never per step."""
    torch = sys.modules.get("torch")   # a tensor implies torch is loaded: the profiler runs without it
    tensor_type = torch.Tensor if torch is not None else ()
    out, by_device = list(values), {}
    for i, v in enumerate(out):
        if isinstance(v, tensor_type):
            by_device.setdefault(v.device, []).append(i)
        else:
            out[i] = float(v)
    for idx in by_device.values():
        with torch.no_grad():   # the deliberate sync, one per device
            floats = torch.stack([out[i].detach().reshape(()) for i in idx]).float().tolist()
        for i, f in zip(idx, floats):
            out[i] = f
    return out


def to_floats_by_name(*groups: dict) -> list:
    """`to_floats` over every {name: values} group at once (one read per device per interval), in order."""
    flat = [v for g in groups for values in g.values() for v in values]
    floats = iter(to_floats(flat))
    return [{name: [next(floats) for _ in values] for name, values in g.items()} for g in groups]
