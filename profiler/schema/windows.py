"""The time a span entry of an interval (or run_end) record stands for, one way for every reader.

GPU times when measured (what `share` uses), else CPU. A CPU total is cut at the window's edges; a GPU
total is never cut, and is scaled to all spans when only some were GPU-timed. Standard library only.
"""
from __future__ import annotations

from collections import Counter

from profiler.schema.gpu_classes import class_of


def basis(entry: dict) -> tuple[dict, str]:
    """(stats, "gpu"|"cpu"): the stats a span's times are read from."""
    if entry.get("gpu"):
        return entry["gpu"], "gpu"
    return entry.get("cpu") or {}, "cpu"


def gpu_scale(entry: dict) -> float:
    """count / gpu_count, scaling the GPU total to all the entry's spans; 1.0 without gpu_count."""
    timed = entry.get("gpu_count")
    return (entry.get("count") or 0) / timed if timed else 1.0


def basis_seconds(entry: dict) -> float:
    """The entry's time in its window: the GPU total scaled to all its spans, else the CPU total."""
    gpu = entry.get("gpu")
    if gpu:   # basis and gpu_scale inline: the report calls this for every entry of every interval
        timed = entry.get("gpu_count")
        return (gpu.get("total_seconds") or 0.0) * ((entry.get("count") or 0) / timed if timed else 1.0)
    return ((entry.get("cpu") or {}).get("total_seconds") or 0.0) * 1.0


def per_call_seconds(entry: dict) -> float | None:
    """The entry's mean seconds per call in its window (None: no count, or no total to read): whole spans where
    it has them (an interval's CPU mean, or its GPU total scaled to all its spans), else its split total over
    its count (a tick window holds no whole spans). basis and gpu_scale inline: called for every entry."""
    count = entry.get("count")
    gpu = entry.get("gpu")
    stats = gpu or entry.get("cpu")
    total = stats.get("total_seconds") if stats else None
    if not count or total is None:
        return None
    if gpu:
        timed = entry.get("gpu_count")
        return total * (count / timed if timed else 1.0) / count
    mean = stats.get("mean_seconds")
    return mean if mean is not None else total / count


def whole_seconds(entry: dict) -> float:
    """The summed whole durations of the entry's spans (behind its mean): the scaled GPU total, or CPU mean x
    count (the CPU total is cut at the window's edges)."""
    stats, on = basis(entry)
    if on == "gpu":
        return basis_seconds(entry)
    mean = stats.get("mean_seconds")
    return mean * (entry.get("count") or 0) if mean is not None else 0.0


def open_at_end(open_spans: list | None) -> dict:
    """{span name: [(thread, open_seconds), ...]}, longest first, from an interval's `open_spans`."""
    out: dict = {}
    for entry in open_spans or ():
        for s in entry.get("spans") or ():
            out.setdefault(s.get("name"), []).append((entry.get("thread"), s.get("open_seconds") or 0.0))
    return {name: sorted(v, key=lambda t: -t[1]) for name, v in out.items()}


# ---- record fields at dict speed: what readers take per interval, per span entry and per GPU in their loops,
# where a profiler.schema.views view (the same fields, typed) costs several times a dict read. Each reads the log's key as
# written (docs/RUNLOG.md): a value is not type-checked here; views.problem did that where a reader computes with it.

def window_index(window: dict) -> int | None:
    """An interval's `index`: its number from 0 in the segment (a tick window: the earlier tick's); None where
    absent."""
    return window.get("index")


def window_final(window: dict) -> bool:
    """An interval's (or tick window's) `final` mark: the run's last."""
    return bool(window.get("final"))


def duration_seconds(window: dict) -> float:
    """An interval's (or tick window's) `duration_seconds`: its length, seconds; 0.0 where it has none."""
    return window.get("duration_seconds") or 0.0


def wall_seconds(windows) -> float:
    """The windows' (intervals' or tick windows') `duration_seconds` summed, seconds."""
    return sum(w.get("duration_seconds") or 0.0 for w in windows)


def counter_total(windows, name: str) -> float:
    """Counter `name`'s `counters.<name>.total` (its count in each window: tokens, steps, ...) summed over the
    windows; 0.0 where none holds it."""
    return sum(((w.get("counters") or {}).get(name) or {}).get("total") or 0.0 for w in windows)


def counter_per_second(window: dict, name: str) -> float | None:
    """Counter `name`'s `counters.<name>.per_second` in one window (its total over the window's duration, per
    second); None where the window has none."""
    return ((window.get("counters") or {}).get(name) or {}).get("per_second")


def span_entries(rec: dict) -> dict:
    """An interval's, tick window's or run_end's `spans`: {span name: its entry (views.SpanEntry reads one)}, as
    written; {} where it has none."""
    return rec.get("spans") or {}


def span_names(windows) -> set:
    """The names of the spans the windows' entries are of (their `spans` keys)."""
    out: set = set()
    for w in windows:
        out.update(w.get("spans") or ())
    return out


def threads_of(entries) -> set:
    """The names of the threads that ran any of the span entries (their `threads`)."""
    return {t for e in entries for t in e.get("threads") or ()}


def most_threads(windows) -> dict:
    """{span name: the most threads one of its entries in the windows names (`threads`)}."""
    most: dict = {}
    for w in windows:
        for name, e in (w.get("spans") or {}).items():
            n = len(e.get("threads") or ())
            if n > most.get(name, 0):
                most[name] = n
    return most


def summed_counts(entries) -> int:
    """Span entries' `count` summed (0 where absent): the spans they collected."""
    return sum(e.get("count") or 0 for e in entries)


def summed_clock_seconds(entries, on: str) -> float:
    """clock_seconds(entry, on) of span entries summed in their order (from 0.0), seconds; inline, as a span's
    entries over a run are many: the split CPU totals (`cpu.total_seconds`), or the GPU totals (`gpu.total_seconds`)
    scaled to all the entry's spans (count / gpu_count), 0.0 where an entry has none."""
    if on == "gpu":
        return sum(_scaled_gpu_seconds(entries), 0.0)
    return sum(((e.get("cpu") or {}).get("total_seconds") or 0.0 for e in entries), 0.0)


def _scaled_gpu_seconds(entries):
    """Each span entry's clock_seconds on the GPU, in order: its `gpu.total_seconds` times count / gpu_count (1.0
    without gpu_count), 0.0 where it has no GPU block."""
    for e in entries:
        gpu = e.get("gpu")
        if not gpu:
            yield 0.0
            continue
        timed = e.get("gpu_count")
        yield (gpu.get("total_seconds") or 0.0) * ((e.get("count") or 0) / timed if timed else 1.0)


def entry_counts(entry: dict) -> tuple:
    """A span entry's (`count`, `gpu_count`, `gpu_unresolved`): its spans collected in the window, those of them with
    GPU times, and those whose CUDA events had not completed; each None where absent (not 0: a check counts only the
    ones written)."""
    return entry.get("count"), entry.get("gpu_count"), entry.get("gpu_unresolved")


def entry_fields(entry: dict) -> tuple:
    """A span entry's (`count`, `gpu_count`, `gpu_unresolved`, `threads`, `share`, `cpu`, `gpu`, `gpu_lag`), each as
    written and None where absent: one call for a loop that reads most of every entry of a run (the check's). Its
    spans collected, those with GPU times and those whose CUDA events had not completed; the names of the threads
    that ran it; its time over the window's duration (a fraction, up to its threads' count); its clock blocks
    (clock_fields); where its CUDA spans lay on the host timeline (views.GpuLag)."""
    return (entry.get("count"), entry.get("gpu_count"), entry.get("gpu_unresolved"), entry.get("threads"),
            entry.get("share"), entry.get("cpu"), entry.get("gpu"), entry.get("gpu_lag"))


def clock_block(entry: dict, on: str) -> dict | None:
    """A span entry's `cpu` or `gpu` block (`on`): its times on that clock (views.ClockStats reads one), as written;
    None where absent or empty (`gpu` without CUDA timing)."""
    return entry.get(on) or None


def clock_fields(block: dict) -> tuple:
    """A clock block's (`p50_seconds`, `p95_seconds`, `p99_seconds`, `max_seconds`, `mean_seconds`, `total_seconds`,
    `self_seconds`, `buckets`), each as written and None where absent: the whole durations of the spans that ended in
    the window (order statistics and mean), its time in the window and that less its children's, seconds, and its
    per-window counts per histogram bound."""
    return (block.get("p50_seconds"), block.get("p95_seconds"), block.get("p99_seconds"), block.get("max_seconds"),
            block.get("mean_seconds"), block.get("total_seconds"), block.get("self_seconds"), block.get("buckets"))


def measured_gpus(rec: dict) -> list:
    """An interval's `memory.gpus`: the NVML per-GPU entries (views.GpuMemory reads one), as written, where its
    `memory.available` says NVML measured them; [] where it did not."""
    mem = rec.get("memory") or {}
    return (mem.get("gpus") or []) if mem.get("available") else []


def measured_memory(rec: dict) -> tuple | None:
    """An interval's (`memory.gpus`, `memory.allocator`), as written ([] and {} where absent), where its
    `memory.available` says NVML measured them; None where it did not."""
    mem = rec.get("memory") or {}
    return ((mem.get("gpus") or []), (mem.get("allocator") or {})) if mem.get("available") else None


def gpu_index(gpu: dict) -> int | None:
    """An NVML GPU entry's `index` (NVML's index of the GPU on its host); None where absent."""
    return gpu.get("index")


def gpu_peak_bytes(gpu: dict) -> tuple:
    """An NVML GPU entry's (`used_bytes_peak`, `total_bytes`): the most memory used in the interval and the GPU's
    memory, bytes; each None where absent."""
    return gpu.get("used_bytes_peak"), gpu.get("total_bytes")


def allocator_bytes(allocator: dict) -> tuple | None:
    """An interval's caching-allocator stats (`memory.allocator`) as (`allocated_bytes`, `peak_reserved_bytes`,
    `peak_allocated_bytes`): allocated now and the most reserved and allocated since the last reset, bytes, each None
    where absent; None where the allocator's `available` says they were not read."""
    if not allocator.get("available"):
        return None
    return allocator.get("allocated_bytes"), allocator.get("peak_reserved_bytes"), allocator.get("peak_allocated_bytes")


def detail_spans(rec: dict) -> list:
    """A detail window's (`spans` record's) `spans`: its kept raw spans (views.RawSpan reads one), as written; []
    where none."""
    return rec.get("spans") or []


def flow_halves(raw_spans: list) -> list:
    """(raw span, its `name`, its `attrs.flow`) of each of a detail window's raw spans (`spans[]`) whose tags carry a
    flow id (the "src:batch" a target's transfer.send and its drafter's drafter.recv share), in order, each as
    written; a span that is not an object has none."""
    out = []
    for span in raw_spans:
        attrs = span.get("attrs") if isinstance(span, dict) else None
        if isinstance(attrs, dict) and attrs.get("flow") is not None:
            out.append((span, span.get("name"), attrs["flow"]))
    return out


def interval_open_spans(rec: dict) -> list:
    """An interval's `open_spans`: per thread, the spans still open at its end (open_at_end reads them;
    views.OpenSpans reads one), as written; [] where none."""
    return rec.get("open_spans") or []


def entry_bytes(entry: dict) -> float | None:
    """A span entry's `bytes`: the bytes its ended spans declared (spans with bytes= only), bytes; None where
    absent."""
    return entry.get("bytes")


def p50_p95_seconds(parts: list) -> tuple[list, list]:
    """([(`p50_seconds`, weight)], [(`p95_seconds`, weight)]) of (clock block, weight) pairs (SpanSums.stats'
    shape): the median and 95th percentile of each block's ended whole spans, seconds, each None where absent."""
    return [(st.get("p50_seconds"), n) for st, n in parts], [(st.get("p95_seconds"), n) for st, n in parts]


def entry_floor(entry: dict) -> tuple:
    """A byte-moving span entry's (`floor`, `floor_bytes_per_s`): the floor of its copy's path (host_staged,
    pinned_d2h, pinned_h2d, device_copy, host_copy) and that floor, bytes/s; each None where absent."""
    return entry.get("floor"), entry.get("floor_bytes_per_s")


def entry_count(entry: dict) -> int:
    """A span entry's `count`: its spans collected complete in the window; 0 where absent (entry_counts gives it
    as written, beside gpu_count and gpu_unresolved)."""
    return entry.get("count") or 0


def window_step(window: dict) -> int | None:
    """An interval's (or tick window's) `step`: the step at its close; None before the first set_step."""
    return window.get("step")


def window_warmup(window: dict) -> bool:
    """An interval's (or tick window's) `warmup` mark: it began before warmup_steps were done."""
    return bool(window.get("warmup"))


def profiler_share(rec: dict) -> float | None:
    """An interval's `profiler_share`: the profiler's and exporters' threads' CPU over its duration_seconds (a
    fraction); None where not measured (tick windows carry none)."""
    return rec.get("profiler_share")


def steps_advanced(rec: dict) -> int | None:
    """An interval's `step_rate.steps`: how far set_step advanced the step in it (its close's minus its start's);
    None where absent or the step went back."""
    return (rec.get("step_rate") or {}).get("steps")


def gauge_mean(rec: dict, name: str) -> float | None:
    """Gauge `name`'s `gauges.<name>.mean` in an interval (the mean of the values set in it: queue_depth, ...);
    None where the interval has none."""
    return ((rec.get("gauges") or {}).get(name) or {}).get("mean")


def gpu_activity_percents(gpu: dict) -> tuple:
    """An NVML GPU entry's (`util_percent_mean`, `sm_active_percent_mean`, `tensor_active_percent_mean`,
    `dram_active_percent_mean`): NVML's busy and GPM's SM, tensor-pipe and DRAM activity over the interval,
    percent; each None where absent (GPM: pre-Hopper, or not measured)."""
    get = gpu.get
    return (get("util_percent_mean"), get("sm_active_percent_mean"), get("tensor_active_percent_mean"),
            get("dram_active_percent_mean"))


# ---- windows: one definition per quantity (docs/REPORT.md, "Windows") --------------------------------

def span_clock(entries) -> str:
    """"gpu" when any of a span's entries has GPU times, else "cpu": one clock over the run, so no time counts
    as open CPU credit in one interval and again as GPU time in the next."""
    return "gpu" if any(e.get("gpu") for e in entries) else "cpu"


def clock_seconds(entry: dict, on: str) -> float:
    """The entry's time on clock `on`: the split CPU total, or the GPU total (0 where no pair resolved)."""
    if on == "gpu":
        gpu = entry.get("gpu")
        if not gpu:
            return 0.0
        timed = entry.get("gpu_count")   # basis_seconds inline
        return (gpu.get("total_seconds") or 0.0) * ((entry.get("count") or 0) / timed if timed else 1.0)
    return (entry.get("cpu") or {}).get("total_seconds") or 0.0


def self_seconds(entry: dict, on: str) -> float:
    """The entry's self (exclusive) time on clock `on`; its total in logs without self time."""
    stats = entry.get("gpu") if on == "gpu" else entry.get("cpu")
    if not stats:
        return 0.0
    own = stats.get("self_seconds")
    if on != "gpu":
        return (stats.get("total_seconds") or 0.0) if own is None else own * 1.0
    timed = entry.get("gpu_count")   # clock_seconds and gpu_scale inline
    return ((stats.get("total_seconds") or 0.0) if own is None else own) * \
        ((entry.get("count") or 0) / timed if timed else 1.0)


class SpanSums:
    """One pass over a span's interval entries on clock `on` (span_clock), each figure summed in entry order as
    clock_seconds, self_seconds, whole_seconds and gpu_scale define it, inline (a week-long log has a million
    entries). Seconds: `total` and `self_total` on `on`, `cpu` (the split CPU totals), `gpu_window` (the scaled GPU
    totals), `gpu_sum` (the GPU totals unscaled), `whole` (CPU mean x count: a CPU-clock span's whole spans).
    Counts: `count` (spans), `timed` (entries with GPU times), `timed_spans` (their spans with GPU times). Per entry
    on `on`: `stats` (its cpu or gpu block, how many spans it is over), `buckets` (that block's `buckets`, None
    where absent) and `longest_seconds` (its `max_seconds`, 0.0 where none ended); `lags`: the entries whose
    `gpu_lag` placed samples (`n`)."""

    def __init__(self, entries: list, on: str):
        self.stats, self.lags, self.buckets, self.longest_seconds = [], [], [], []
        self.total = self.self_total = self.cpu = self.gpu_window = self.whole = self.gpu_sum = 0.0
        self.count = self.timed_spans = self.timed = 0
        stats, buckets, longest, gpu_clock = self.stats, self.buckets, self.longest_seconds, on == "gpu"
        for e in entries:
            count, cpu, gpu = e.get("count") or 0, e.get("cpu") or {}, e.get("gpu")
            self.count += count
            self.cpu += cpu.get("total_seconds") or 0.0
            if (e.get("gpu_lag") or {}).get("n"):
                self.lags.append(e)
            if gpu:
                timed = e.get("gpu_count")
                scale = count / timed if timed else 1.0
                total = gpu.get("total_seconds") or 0.0
                self.timed += 1
                self.timed_spans += e.get("gpu_count", count)
                self.gpu_window += total * scale
            if gpu_clock:
                if gpu:
                    stats.append((gpu, timed or count))
                    buckets.append(gpu.get("buckets"))
                    longest.append(gpu.get("max_seconds") or 0.0)
                    own = gpu.get("self_seconds")
                    self.total += total * scale
                    self.self_total += (total if own is None else own) * scale
                    self.gpu_sum += total
                continue
            stats.append((cpu, count))
            buckets.append(cpu.get("buckets"))
            longest.append(cpu.get("max_seconds") or 0.0)
            own, total = cpu.get("self_seconds"), cpu.get("total_seconds") or 0.0
            self.total += total
            self.self_total += total if own is None else own * 1.0
            mean = cpu.get("mean_seconds")   # whole_seconds: no entry of a CPU-clock span has GPU times
            self.whole += mean * count if mean is not None else 0.0


def phase_seconds(intervals: list, phase_spans) -> dict:
    """{phase span: self CPU seconds} summed over `intervals` (the phases' own time, nesting left out)."""
    out = Counter()
    for rec in intervals:
        out.update({name: self_seconds(e, "cpu") for name in phase_spans if (e := (rec.get("spans") or {}).get(name))})
    return dict(out)


STEADY_PHASE_SHARE_MAX = 0.1
"""An interval with more than this share of its wall in phases (compile, evaluation, a checkpoint) is a phase
interval, not steady work: a window read over it would average the phase in."""


def phase_share(rec: dict, phase_spans) -> float:
    """The share of the interval's wall its phases took: their self CPU seconds in it (cut at its edges, an open
    phase's time so far included) over its duration."""
    wall = rec.get("duration_seconds") or 0.0
    if wall <= 0 or not phase_spans:
        return 0.0
    spans = rec.get("spans") or {}
    # phase_seconds([rec], ...) without its Counter: one value per phase name, summed in the same order
    return sum({name: self_seconds(e, "cpu") for name in phase_spans if (e := spans.get(name))}.values()) / wall


def is_steady(rec: dict, phase_spans) -> bool:
    """The interval is steady work: past warm-up (no `warmup` mark), not the run's last (`final`), and at most
    STEADY_PHASE_SHARE_MAX of it in phases. Every reader's steady intervals are these."""
    return not rec.get("warmup") and not rec.get("final") and phase_share(rec, phase_spans) <= STEADY_PHASE_SHARE_MAX


def past_warm_up(windows: list) -> list:
    """The windows past warm-up and before the run's last. Where none of a rank's windows is_steady, its figures
    are read over these (each then over a tenth in phases: a drafter that recompiles all along), or over all of
    them where these are none."""
    return [w for w in windows if not w.get("warmup") and not w.get("final")]


def steady_throughput(events: list) -> dict | None:
    """A rank's steady state from its `throughput` events (one per segment, dflash/throughput.py): their
    tokens over their seconds; None when no segment got past warm-up."""
    segs = [e for e in events if e.get("kind") == "throughput" and e.get("steady_seconds")]
    if not segs:
        return None
    seconds = sum(e["steady_seconds"] for e in segs)
    tokens = sum(e.get("steady_tokens") or 0 for e in segs)
    flops = sum(e.get("steady_model_flops") or 0.0 for e in segs)
    phases = Counter()
    for e in segs:
        phases.update({name: s or 0.0 for name, s in (e.get("phases_seconds") or {}).items()})
    return {"window": "steady state", "steady_tokens_per_s": tokens / seconds if seconds > 0 else None,
            "steady_tokens": tokens, "steady_seconds": seconds, "steady_steps": sum(e.get("steady_steps") or 0
                                                                                   for e in segs),
            "segments": len(segs), "phases_seconds": dict(phases),
            "steady_model_flops_per_s": flops / seconds if flops > 0 and seconds > 0 else None}


def summed_mfu(ranks) -> dict:
    """{peak: the ranks' summed model FLOP/s over their summed peak} over (model FLOP/s, run_start compute_peaks)
    of a role's ranks, each peak over the ranks that have both a rate and that peak: a role's MFU."""
    rates, peaks = {}, {}
    for rate, rank_peaks in ranks:
        for name in mfu(rate, rank_peaks):   # the peaks with a positive figure, where there is a rate
            rates[name] = rates.get(name, 0.0) + rate
            peaks[name] = peaks.get(name, 0.0) + rank_peaks[name]["flops_per_s"]
    return {name: rates[name] / peaks[name] for name in rates}


def compute_clause(flops_per_s: float | None, ratios: dict, whats: dict) -> str:
    """`model 12.3 TFLOP/s, MFU 1.2% of datasheet dense bf16 (H100/H200 SXM), 1.5% of measured (bf16 8192x8192x8192
    matmul ...)` for a rate, its MFU per peak and each peak's `what`; "" without a rate (a loop that counts no
    model FLOPs). The console's and the report's one wording."""
    if flops_per_s is None:
        return ""
    said = [f"{ratios[n]:.1%} of {whats.get(n) or n}" if n == "datasheet" else f"{ratios[n]:.1%} of {n} "
            f"({whats.get(n) or 'no description'})" for n in ("datasheet", "measured") if n in ratios]
    rate = f"{flops_per_s / 1e12:.3g} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.3g} GFLOP/s"
    return f"model {rate}" + (f", MFU {', '.join(said)}" if said else "")


def mfu(flops_per_s: float | None, peaks: dict) -> dict:
    """{peak: model FLOP/s over it}, the model FLOPs utilisation against each of a run_start's `compute_peaks`
    ("datasheet", "measured": {"flops_per_s", "what"}) that has a positive figure; {} without a rate."""
    if flops_per_s is None:
        return {}
    return {name: flops_per_s / p["flops_per_s"] for name, p in (peaks or {}).items()
            if isinstance(p, dict) and isinstance(p.get("flops_per_s"), (int, float)) and p["flops_per_s"] > 0}


# ---- what the GPU did in a span (profiler/gpu_lag.py) -------------------------------------------------------

def gpu_bound(entries, capture_busy_share: float | None = None, sm_active_percent: float | None = None) -> dict | None:
    """A span's class over the window its interval `entries` cover: launch-bound / GPU-bound / mixed from its
    entries' `gpu_lag` samples (class_of), the lags' medians (of the intervals' p50s), and the busy estimate
    beside it: the capture's busy share (kernels over our GPU window, profiler/report/kernels.py) where a capture has the
    span, else the GPU's SM activity (GPM) over the window, else none. None when no sample was placed."""
    lags = [e["gpu_lag"] for e in entries if (e.get("gpu_lag") or {}).get("n")]
    if not lags:
        return None
    n = sum(g["n"] for g in lags)
    launch, gpu = sum(g["launch_bound"] for g in lags), sum(g["gpu_bound"] for g in lags)
    busy, source = ((capture_busy_share, "capture") if capture_busy_share is not None else
                    (sm_active_percent / 100.0, "GPM SM active") if sm_active_percent is not None else (None, None))
    return {"class": class_of(launch, gpu, n), "samples": n, "intervals": len(lags),
            "launch_bound_share": launch / n, "gpu_bound_share": gpu / n,
            "start_lag_p50_s": _median_of(g.get("start_lag_p50_s") for g in lags),
            "end_lag_p50_s": _median_of(g.get("end_lag_p50_s") for g in lags),
            "busy_share": busy, "busy_source": source}


def _median_of(values) -> float | None:
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


# ---- tick windows: sub-interval windows from the cumulative `tick` records (docs/RUNLOG.md) ----------

def _tick_span_delta(now: dict, before: dict | None) -> dict | None:
    """One span's change between two ticks, shaped as an interval's span entry; None when nothing changed."""
    before = before or {}

    def d(key):
        return (now.get(key) or 0) - (before.get(key) or 0)

    entry = {"count": d("count"), "cpu": {"total_seconds": d("cpu_seconds"), "self_seconds": d("self_seconds")},
             "gpu": None}
    if "gpu_seconds" in now:
        entry["gpu"] = {"total_seconds": d("gpu_seconds"), "self_seconds": d("gpu_self_seconds")}
        if "gpu_count" in now:
            entry["gpu_count"] = d("gpu_count")
        if not entry["gpu"]["total_seconds"] and not entry.get("gpu_count"):
            entry["gpu"] = None   # no CUDA pair resolved in this window: the span's time here is CPU only
            entry.pop("gpu_count", None)
    changed = entry["count"] or entry["cpu"]["total_seconds"] or entry["cpu"]["self_seconds"] or entry["gpu"]
    return entry if changed else None


def _tick_metric_means(before: dict, now: dict) -> dict:
    """{name: {"mean": the mean of the finite values recorded between two ticks}}, an interval's metrics shape,
    for each metric recorded in the window (its cumulative count moved)."""
    out = {}
    for name, m in (now.get("metrics") or {}).items():
        b = (before.get("metrics") or {}).get(name) or {}
        d_count = (m.get("count") or 0) - (b.get("count") or 0)
        if d_count > 0:
            out[name] = {"mean": ((m.get("sum") or 0.0) - (b.get("sum") or 0.0)) / d_count}
    return out


def _tick_window(before: dict, now: dict, index: int) -> dict:
    """The interval-shaped window between two ticks of one segment (tick_windows); `index` is the earlier
    tick's (0: the segment's first window), `time_unix` the later tick's, as an interval's."""
    duration = now["t_s"] - before["t_s"]
    spans = {}
    for name, s in (now.get("spans") or {}).items():
        e = _tick_span_delta(s, (before.get("spans") or {}).get(name))
        if e is not None:
            spans[name] = e
    counters = {}
    for name, total in (now.get("counters") or {}).items():
        delta = total - ((before.get("counters") or {}).get(name) or 0)
        counters[name] = {"total": delta, "per_second": delta / duration}
    out = {"index": index, "start_s": before["t_s"], "end_s": now["t_s"], "duration_seconds": duration,
           "time_unix": now.get("time_unix"), "step": now.get("step"), "source": "ticks",
           "spans": spans, "counters": counters, "metrics": _tick_metric_means(before, now)}
    if before.get("warmup"):
        out["warmup"] = True
    if now.get("final"):
        out["final"] = True
    return out


def tick_windows(ticks: list) -> list:
    """Each consecutive pair of one segment's `tick` records (their `index` runs 0, 1, 2 ...; a resume starts
    again at 0) as an interval-shaped dict that is_steady, phase_share, clock_seconds, self_seconds,
    basis_seconds and span_clock read unchanged: the spans' and counters' changes between the two instants,
    "warmup" when the earlier tick was in warm-up, "final" when the later one is the run's final close. Two ticks
    at one instant (a timer tick beside an interval close) make no window; a final mark moves to the window
    before."""
    out, before = [], None
    for now in ticks:
        if before is None or now.get("index", 0) <= before.get("index", 0):   # a segment's first tick
            before = now
            continue
        if now["t_s"] - before["t_s"] > 0:
            out.append(_tick_window(before, now, before.get("index", 0)))
        elif now.get("final") and out and out[-1]["end_s"] == before["t_s"]:
            out[-1]["final"] = True
        before = now
    return out
