"""The report's analyses of memory (headroom low points, allocator trends, leaks), events (problems first) and
stacks (hot frames per thread)."""
from __future__ import annotations

import statistics
from collections import Counter

from profiler.schema import views
from profiler.threadcpu import is_profiler_thread
from profiler.report.runs import Run, gpu_key, steady_window, wall_seconds

# Event kinds that mean something went wrong, shown first and with examples.
PROBLEM_KINDS = ("nonfinite", "oom", "thread_crash", "hang", "signal", "bad_records", "stop")
EXAMPLES_PER_KIND = 3
FRAMES_PER_THREAD = 5
_TEXT_LIMIT = 300
# A memory leak (memory_trend): a sustained climb after warm-up, beyond the noise, large against the GPU.
TREND_MIN_SAMPLES = 6         # intervals after warm-up before a trend is read at all
TREND_MAX_POINTS = 400        # pairwise slopes over at most this many points (160k pairs)
NOISE_MADS = 3.0              # the rise over the window must exceed this many residual MADs
LEAK_TOTAL_SHARE = 0.03       # ... and this share of the GPU's memory, or exhaust its headroom within the run


def _low_point(log, rec, g, t0: float | None) -> dict:
    """An interval's headroom (views.Interval, views.GpuMemory), and its dominant span: the one with the largest
    share, where its time went (the memory peak has no span)."""
    spans = rec.spans.items()
    name, top = max(spans, key=lambda kv: kv[1].share or 0.0) if spans else (None, None)
    t = rec.time_unix
    return {"headroom_bytes": g.headroom_bytes, "headroom_ratio": g.headroom_bytes / g.total_bytes,
            "used_bytes_peak": g.used_bytes_peak, "time_unix": t,
            "seconds_since_start": t - t0 if t is not None and t0 is not None else None,
            "rank": log.rank, "interval": rec.index, "step": rec.step,
            "dominant_span": name, "dominant_span_share": top.share if name else None}


def theil_sen(xs: list, ys: list) -> tuple[float, float]:
    """(slope, intercept): the median pairwise slope, which one outlier cannot move (over at most
    TREND_MAX_POINTS strided points, so a day of intervals stays quick), and the median of y - slope * x."""
    import numpy as np   # the pairs as one array: 80k of them a trend, 32 trends in an 8-rank report

    stride = max(1, -(-len(xs) // TREND_MAX_POINTS))
    px, py = np.asarray(xs[::stride], dtype=float), np.asarray(ys[::stride], dtype=float)
    i, j = np.triu_indices(len(px), k=1)
    dx = px[j] - px[i]
    apart = dx != 0
    slopes = (py[j] - py[i])[apart] / dx[apart]
    slope = float(np.median(slopes)) if slopes.size else 0.0
    return slope, float(np.median(np.asarray(ys, dtype=float) - slope * np.asarray(xs, dtype=float)))


def _after_warmup(log) -> tuple[list, str, bool]:
    """(intervals, their window's name, steady): the last segment's steady intervals less their first tenth (at
    least one), while the caching allocator still fills to the batches' high water: what a memory trend is read
    over. A rank with no steady interval gets all of the segment's, named so, and never a leak."""
    last_start = max((i for i, r in enumerate(map(views.interval, log.intervals)) if r.index == 0), default=0)
    segment = {id(r) for r in log.intervals[last_start:]}
    w = steady_window(log, ticks=False)   # the allocator's series: interval records only
    kept = [r for r in w.intervals if id(r) in segment]
    which = "steady intervals" if not w.fallback else "intervals (none steady: warm-up, phases or final)"
    return kept[max(1, len(kept) // 10):], f"the last segment's {which} less their first tenth", not w.fallback


def _leak_test(t: dict) -> tuple[bool, str]:
    """(leak, why): a rise beyond NOISE_MADS x the residual MAD, still climbing in the last half, and large
    against the GPU (over LEAK_TOTAL_SHARE of it, or exhausting the headroom within the run's length)."""
    if not t["steady"]:
        return False, "no interval past warm-up: a trend there is the allocator filling, not a leak"
    if t["samples"] < TREND_MIN_SAMPLES:
        return False, f"{t['samples']} samples after warm-up, under {TREND_MIN_SAMPLES}"
    if t["rise_bytes"] <= NOISE_MADS * t["mad_bytes"] or t["slope_bytes_per_s"] <= 0:
        return False, f"rise within {NOISE_MADS:g}x the interval-to-interval noise (residual MAD)"
    if t["last_half_slope_bytes_per_s"] < 0.5 * t["slope_bytes_per_s"]:
        return False, "not sustained: the last half of the window climbs at under half the slope"
    if not t["total_bytes"]:
        return False, "no GPU total to weigh it against (no NVML)"
    exhausts = t["seconds_to_exhaust"] is not None and t["seconds_to_exhaust"] <= t["run_seconds"]
    if t["rise_bytes"] < LEAK_TOTAL_SHARE * t["total_bytes"] and not exhausts:
        return False, f"small: under {LEAK_TOTAL_SHARE:.0%} of the GPU and the headroom outlasts the run's length"
    return True, "sustained, beyond the noise and large against the GPU"


def _at_s(rec) -> float | None:
    """Where an interval lies on a trend's x axis: its end on the interval clock, else its time_unix."""
    return rec.end_s if rec.end_s is not None else rec.time_unix


def memory_trend(log, pts: list, key: str, window: str, steady: bool) -> dict:
    """One allocator series (`allocated_bytes` or `reserved_bytes`, a views.Allocator field) over `pts` ((x: the
    interval's place on the axis, _at_s; y: the series' bytes; the views.Interval) of its window after warm-up,
    named `window`): Theil-Sen slope, residual MAD, rise, when the GPU headroom would run out, and whether that is
    a leak (`leak`, `why`; only in a `steady` window)."""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    slope, intercept = theil_sen(xs, ys) if pts else (0.0, 0.0)
    resid = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    mid = statistics.median(resid) if resid else 0.0
    half = len(pts) // 2
    nvml = next((g for r in reversed([p[2] for p in pts]) for g in r.measured_gpus if g.total_bytes),
                views.GpuMemory.of(None))
    headroom = nvml.headroom_bytes
    t = {"series": key, "window": window, "steady": steady, "samples": len(pts),
         "intervals": [pts[0][2].index, pts[-1][2].index] if pts else None,
         "window_seconds": xs[-1] - xs[0] if pts else 0.0, "first_bytes": ys[0] if pts else None,
         "last_bytes": ys[-1] if pts else None, "slope_bytes_per_s": slope,
         "last_half_slope_bytes_per_s": theil_sen(xs[half:], ys[half:])[0] if half >= 2 else 0.0,
         "mad_bytes": statistics.median(abs(r - mid) for r in resid) if resid else 0.0,
         "rise_bytes": slope * (xs[-1] - xs[0]) if pts else 0.0, "total_bytes": nvml.total_bytes,
         "headroom_bytes": headroom, "run_seconds": wall_seconds(log.intervals),
         "seconds_to_exhaust": headroom / slope if headroom is not None and slope > 0 else None}
    t["leak"], t["why"] = _leak_test(t)
    return t


def _allocator_trend(log, pairs: list) -> dict | None:
    """The rank's allocator over its intervals (`pairs`: (record, views.Interval, views.Allocator) of each interval
    that read it): first and last figures, and the trends after warm-up."""
    if not pairs:
        return None
    allocs = [a for _, _, a in pairs]
    first, last = allocs[0], allocs[-1]
    kept, window, is_steady = _after_warmup(log)
    warm = {id(r) for r in kept}
    steady = [(x, iv, a) for r, iv, a in pairs if id(r) in warm and (x := _at_s(iv)) is not None]
    return {"rank": log.rank, "role": log.role, "intervals": len(allocs),
            "alloc_retries_first": first.num_alloc_retries, "alloc_retries_last": last.num_alloc_retries,
            "ooms_last": last.num_ooms, "reserved_bytes_first": first.reserved_bytes,
            "reserved_bytes_last": last.reserved_bytes,
            "reserved_bytes_peak": max((a.peak_reserved_bytes or a.reserved_bytes or 0) for a in allocs),
            "reserved_series_bytes": [a.reserved_bytes for a in allocs],
            "trends": {key: memory_trend(log, [(x, y, iv) for x, iv, a in steady if (y := getattr(a, key)) is not None],
                                         key, window, is_steady)
                       for key in ("allocated_bytes", "reserved_bytes")}}


def _gpu_row(key: str, samples: list) -> dict:
    """One GPU from its (log, interval, gpu entry, run start's time_unix) samples; the low point is the first least
    headroom."""
    log, _, g, _ = samples[0]
    entries = [s[2] for s in samples]
    return {"gpu": key, "host": log.hostname, "index": g.index, "name": g.name,
            "total_bytes": g.total_bytes, "ranks": sorted({s[0].rank for s in samples}), "intervals": len(samples),
            "low_point": _low_point(*min(samples, key=lambda s: s[2].headroom_bytes)),
            "used_bytes_peak": max([0] + [e.used_bytes_peak or 0 for e in entries]),
            "throttle_intervals": dict(Counter(r for e in entries for r in e.throttle_reasons or [])),
            "last_headroom_bytes": entries[-1].headroom_bytes}


def headroom(run: Run) -> dict:
    """{"measured", "reason", "gpus": [per GPU (host:index): low point, last headroom, throttle intervals],
    "allocator": [per rank trend]}; headroom = total minus the interval's NVML peak used."""
    samples: dict = {}
    reasons, allocator = set(), []
    for log in run.ranks.values():   # each interval's memory read once, for the GPUs and the allocator
        t0 = next((s.time_unix for s in map(views.run_start, log.run_starts)), None)
        pairs = []
        for r in log.intervals:
            rec = views.interval(r)
            mem = rec.memory
            alloc = mem.allocator
            if alloc.available:
                pairs.append((r, rec, alloc))
            if not mem.available:
                reasons.add(mem.reason or "no memory record")
                continue
            for g in mem.gpus:
                if g.headroom_bytes is not None and g.total_bytes:
                    samples.setdefault(gpu_key(log, g.raw), []).append((log, rec, g, t0))
        trend = _allocator_trend(log, pairs)
        if trend is not None:
            allocator.append(trend)
    gpus = [_gpu_row(key, s) for key, s in samples.items()]
    reason = None if gpus else "no GPU memory measured" + (f" ({'; '.join(sorted(reasons))})" if reasons else "")
    return {"measured": bool(gpus), "reason": reason, "gpus": gpus, "allocator": allocator}


def _example(ev) -> dict:
    """An event shown whole (views.Event): its rank, its own fields (long strings cut) and its time_unix."""
    out = {k: v[:_TEXT_LIMIT] + "..." if isinstance(v, str) and len(v) > _TEXT_LIMIT else v
           for k, v in ev.body().items()}
    return {"rank": ev.rank, **out, "time_unix": ev.time_unix}


def events(run: Run) -> dict:
    """{"kinds": {kind: {"count", "ranks", "examples"}}, "problems"}, with unparsable lines `bad_lines`, failed
    segments `run_failed`, logs without run_end `no_run_end`."""
    kinds: dict = {}

    def add(kind: str, rank: int, example: dict, count: int = 1) -> None:
        k = kinds.setdefault(kind, {"count": 0, "ranks": [], "examples": []})
        k["count"] += count
        k["ranks"] = sorted(set(k["ranks"]) | {rank})
        if len(k["examples"]) < EXAMPLES_PER_KIND:
            k["examples"].append(example)

    for log in run.ranks.values():
        for ev in map(views.event, log.events):
            add(str(ev.kind), log.rank, _example(ev))
        if log.bad_lines:
            add("bad_lines", log.rank, {"rank": log.rank, "lines": log.bad_lines, "where": log.bad_examples},
                count=log.bad_lines)
        for end in map(views.run_end, log.run_ends):
            if end.status not in (None, "ok"):
                add("run_failed", log.rank, {"rank": log.rank, "status": end.status, "step": end.step})
        if len(log.run_ends) < len(log.run_starts):
            add("no_run_end", log.rank, {"rank": log.rank, "last_step": max(
                (views.interval(r).step or 0 for r in log.intervals), default=None)})
    order = (*PROBLEM_KINDS, "run_failed", "no_run_end", "bad_lines")
    return {"kinds": kinds, "problems": [k for k in order if k in kinds]}


def _thread_acc(threads: dict, rank: int, t) -> dict:
    """The accumulator of a thread (views.SampledThread or views.SnapshotThread: both name it and its OS id)."""
    key = (rank, t.name)
    return threads.setdefault(key, {"rank": rank, "thread": t.name, "native_id": t.native_id,
                                    "stack_samples": 0, "frames": Counter(), "snapshots": 0, "stuck_snapshots": 0,
                                    "snapshot_frames": Counter(), "open_spans": []})


def hot_frames(run: Run) -> dict:
    """Per thread, hottest first: its stack samples' top frames, and its snapshots' innermost frames, stuck count
    and open spans; the training's threads in "threads", the profiler's and its exporters' own (profiler.*,
    threadcpu.is_profiler_thread) apart in "profiler_threads", so they never crowd out the training's."""
    threads: dict = {}
    for log in run.ranks.values():
        for rec in map(views.interval, log.intervals):
            samples = rec.stack_samples
            for t in samples.threads:
                acc = _thread_acc(threads, log.rank, t)
                acc["stack_samples"] += samples.samples or 0
                for f in t.top_frames:
                    acc["frames"][f.frame] += f.count
        for snap in map(views.snapshot, log.snapshots):
            for t in snap.threads:
                acc = _thread_acc(threads, log.rank, t)
                acc["snapshots"] += 1
                acc["stuck_snapshots"] += t.stuck
                if t.frames:
                    acc["snapshot_frames"][t.frames[0]] += 1
                acc["open_spans"] = [s.raw for s in t.open_spans] or acc["open_spans"]
    out = []
    for acc in threads.values():
        n = acc["stack_samples"]
        acc["top_frames"] = [{"frame": f, "count": c, "share": c / n if n else None}
                             for f, c in acc.pop("frames").most_common(FRAMES_PER_THREAD)]
        acc["snapshot_frames"] = [{"frame": f, "count": c}
                                  for f, c in acc["snapshot_frames"].most_common(FRAMES_PER_THREAD)]
        out.append(acc)
    out.sort(key=lambda a: (-sum(f["count"] for f in a["top_frames"]), -a["stuck_snapshots"], -a["snapshots"],
                            a["rank"]))
    how = ("run with --stack-samples-per-interval N" if run.pipeline else
           "give the Profiler deps=ProfilerDeps(stack_sampler=profiler.stacks.make_stack_sampler(os.getpid(), N, "
           "interval_s))")
    reason = None if out else (f"no stack samples or snapshots in the logs ({how}, or take one with dflash-profile "
                               "snapshot)")
    return {"threads": [a for a in out if not is_profiler_thread(a["thread"])],
            "profiler_threads": [a for a in out if is_profiler_thread(a["thread"])], "reason": reason}

