"""The plots of `dflash-report html` (profiler/report/html.py), from a loaded run: span self time stacked per role,
tokens/s, loss and tau (the series `--plot` draws: profiler/report/plot.py's `timeline`), GPU memory headroom, the
allocator's memory per rank, and the NVML/GPM counters per GPU (read from the interval records through
profiler/schema/views.py). A series longer than a plot's share of points is downsampled: consecutive windows in buckets
of k, each bucket one point (the mean, or the lowest headroom and the highest memory in use), and every plot says
its window, its sample count and the bucketing. Standard library only.
"""
from __future__ import annotations

import math

from profiler.schema import views
from profiler.report.html_svg import Line, frame_for, line_chart, stacked_chart
from profiler.report.plot import TRAIN_METRICS, _top_spans, start_unix
from profiler.report.runs import Run, gpu_key

PLOT_POINTS = 1200
"""Points one line plot draws at most, over all its lines (each line gets an equal share, MIN_POINTS at least)."""
MAX_POINTS, MIN_POINTS = 240, 24
"""Points one line (or columns one stacked plot) draws at most, and at least before any is bucketed."""
GIB = 1024 ** 3
GPU_COUNTERS = (("util_percent_mean", "NVML GPU busy (a kernel ran in the sample period)", "percent", 1.0),
                ("sm_active_percent_mean", "GPM SM active", "percent", 1.0),
                ("tensor_active_percent_mean", "GPM tensor pipes active", "percent", 1.0),
                ("dram_active_percent_mean", "GPM DRAM bandwidth over its peak", "percent", 1.0),
                ("power_watts_mean", "power draw", "watts", 1.0))
"""(GpuMemory field, what it is, unit, scale) of each counter plotted per GPU where an interval record has it."""


def bucket_size(n: int, lines: int = 1) -> int:
    """k: windows per point so that `lines` lines of `n` points stay within their share of PLOT_POINTS."""
    share = min(MAX_POINTS, max(MIN_POINTS, PLOT_POINTS // max(lines, 1)))
    return max(1, math.ceil(n / share))


def _agg(values: list, how: str):
    seen = [v for v in values if v is not None]
    if not seen:
        return None
    return min(seen) if how == "min" else max(seen) if how == "max" else sum(seen) / len(seen)


def bucketed(seconds: list, values: list, k: int, how: str = "mean") -> tuple[list, list]:
    """(seconds, values) with each k consecutive points one: its last time and the `how` (mean, min, max) of its
    values (None where it holds none)."""
    if k <= 1:
        return list(seconds), list(values)
    return ([seconds[min(i + k, len(seconds)) - 1] for i in range(0, len(seconds), k)],
            [_agg(values[i:i + k], how) for i in range(0, len(values), k)])


def sampling(k: int, window: str, how: str = "mean") -> str:
    """How one point was made, in words."""
    if k <= 1:
        return f"one point per {window}"
    what = {"mean": "mean", "min": "lowest", "max": "highest"}[how]
    return f"each point the {what} of {k} consecutive samples (downsampled to bound the page)"


def _window(tl: dict, source: str) -> str:
    """One point's window in words ("5 s tick window", "60 s interval"), as plot.py names it."""
    length = tl["window_s"] if source == tl["source"] else tl["interval_s"]
    return f"{length:.2g} s " + ("tick window" if source == "ticks" else "interval")


def _span(seconds: list) -> str:
    return f"{seconds[0]:.0f}-{seconds[-1]:.0f} s" if seconds else "none"


def role_stacks(tl: dict) -> list:
    """One figure per role with spans: its self CPU seconds per window, stacked by span (plot.py's layers)."""
    out, window = [], _window(tl, tl["source"])
    for role, s in tl["roles"].items():
        layers, n = _top_spans(s["spans"]), len(s["seconds"])
        if not layers or not n:
            continue
        k = bucket_size(n)
        ends, _ = bucketed(s["seconds"], s["seconds"], k)
        cols = [(label, bucketed(s["seconds"], values, k)[1]) for label, values in layers]
        totals = [sum(vals[j] or 0.0 for _, vals in cols) for j in range(len(ends))]
        f = frame_for(totals, ends[-1], f"self CPU s per {window}")
        title = (f"{role}: self CPU time (host wall, children left out) per {window}, stacked by span, summed over "
                 f"{s['ranks']} rank(s); whole run: {n} windows ({_span(s['seconds'])}); {sampling(k, window)}")
        out.append({"id": f"plot-spans-{len(out)}", "title": title,
                    "svg": stacked_chart(title, [s["start_seconds"], *ends], cols, f)})
    return out


def rate_lines(tl: dict) -> list:
    """tokens/s per role, then each training metric per role that recorded it."""
    out = []
    rates = [(role, s["seconds"], s["tokens_per_s"]) for role, s in tl["roles"].items() if any(s["tokens_per_s"])]
    if rates:
        out.append(_lines("plot-tokens", "tokens/s per role (sum over its ranks' rates)", "tokens/s", rates,
                          _window(tl, tl["source"]), from_zero=True))
    for name, words in TRAIN_METRICS.items():
        series = [(role, s["metric_seconds"], s["metrics"][name]) for role, s in tl["roles"].items()
                  if name in s["metrics"]]
        if series:
            out.append(_lines(f"plot-{name}", f"{words} (each window's mean of the values recorded in it, over the "
                              "role's ranks)", name, series, _window(tl, tl["metric_source"]), from_zero=False))
    return out


def _lines(fig_id: str, what: str, y_label: str, series: list, window: str, from_zero: bool, how: str = "mean",
           hlines=()) -> dict:
    """A line figure from (label, seconds, values) series: bucketed alike, titled with window, counts and sampling."""
    last = max((t[-1] for _, t, _ in series if t), default=0.0)
    series = [(label, [x for x, v in zip(t, vals) if v is not None], [v for v in vals if v is not None])
              for label, t, vals in series]   # a window without a value is left out, as --plot leaves it
    k = bucket_size(max(len(t) for _, t, _ in series), len(series))
    lines = [Line(f"{label} ({len(vals)})", *bucketed(t, vals, k, how)) for label, t, vals in series]
    counts = ", ".join(f"{label} {len(vals)}" for label, _, vals in series)
    title = (f"{what} per {window}; whole run ({_span([0.0, last])}): samples {counts}; {sampling(k, window, how)}")
    f = frame_for([v for line in lines for v in line.values], last, y_label, from_zero, hlines)
    return {"id": fig_id, "title": title, "svg": line_chart(title, lines, f)}


def memory_lines(run: Run, tl: dict) -> list:
    """GPU memory headroom per GPU (lowest per bucket; dashed: 5% of each GPU size) and the allocator's reserved and
    allocated memory per rank (highest per bucket), per interval record."""
    out, gpus = [], tl["gpus"]
    if gpus:
        totals = sorted({g["total_bytes"] for g in gpus.values() if g["total_bytes"]})
        out.append(_lines("plot-headroom", "GPU memory headroom per GPU (NVML: total minus the interval's peak used)",
                          "headroom GiB", [(f"gpu {gpu}", g["seconds"], [h / GIB for h in g["headroom_bytes"]])
                                           for gpu, g in sorted(gpus.items())],
                          f"{tl['interval_s']:.2g} s interval record", from_zero=True, how="min",
                          hlines=[(f"5% of a {t / GIB:.0f} GiB GPU", 0.05 * t / GIB) for t in totals]))
    t0, series = start_unix(run), []
    for rank, log in sorted(run.ranks.items()):
        pts = [(rec.time_unix - t0, a) for rec in map(views.interval, log.intervals)
               if (a := rec.memory.allocator).available]
        for key in ("reserved_bytes", "allocated_bytes"):
            if any(getattr(a, key) is not None for _, a in pts):
                series.append((f"rank {rank} {key.split('_')[0]}", [t for t, _ in pts],
                               [None if getattr(a, key) is None else getattr(a, key) / GIB for _, a in pts]))
    if series:
        out.append(_lines("plot-allocator", "CUDA caching allocator per rank, at each interval's close", "GiB",
                          series, f"{tl['interval_s']:.2g} s interval record", from_zero=True, how="max"))
    return out


def gpu_counter_lines(run: Run, tl: dict) -> list:
    """One figure per NVML/GPM counter some interval record carries: per GPU (host:index), the interval means, the
    ranks sharing a GPU merged in time order."""
    t0, per_gpu = start_unix(run), {}
    for log in run.ranks.values():
        for rec in map(views.interval, log.intervals):
            for g in rec.measured_gpus:
                per_gpu.setdefault(gpu_key(log, g.raw), []).append((rec.time_unix - t0, g))
    out = []
    for field, what, unit, scale in GPU_COUNTERS:
        series = []
        for gpu, pts in sorted(per_gpu.items()):
            pts = sorted((p for p in pts if getattr(p[1], field) is not None), key=lambda p: p[0])
            if pts:
                series.append((f"gpu {gpu}", [t for t, _ in pts], [getattr(g, field) * scale for _, g in pts]))
        if series:
            out.append(_lines(f"plot-gpu-{field}", f"{what} per GPU, the interval's mean", unit, series,
                              f"{tl['interval_s']:.2g} s interval record", from_zero=True))
    return out


def figures(run: Run, tl: dict) -> list:
    """Every plot the run has data for, top to bottom: {id, title, svg}."""
    return role_stacks(tl) + rate_lines(tl) + memory_lines(run, tl) + gpu_counter_lines(run, tl)
