"""`dflash-report hotspots --plot FILE`: a PNG of a run over time (span time per window stacked by span per role
and tokens/s per role, and the training's loss and acceptance length tau, per tick window where the run wrote
ticks, else per interval; headroom per GPU per interval; every line in time order), one panel per
quantity the run measured: a CPU run has no headroom panel, a loop without `tau` no tau panel. matplotlib is
imported by `plot_run` only.

The stacks are self (exclusive) CPU time: host wall time, children left out and split across intervals
exactly, so a child is never stacked on its parent and a stack stays within the role's threads x interval
(GPU windows are not split, and would land whole in the interval where they resolve).
"""
from __future__ import annotations

from profiler.schema import views
from profiler.report.runs import Run, gpu_key

TOP_SPANS = 7   # per role; the rest are drawn as "other"
GIB = 1024 ** 3
TRAIN_METRICS = {"loss": "loss", "tau": "acceptance length tau (simulated)"}
"""The windows' `metrics` drawn (tick windows' where the ticks carry them, else the intervals'), each in a panel of
its own when some rank recorded it."""


def timeline(run: Run) -> dict:
    """{"interval_s", "window_s", "source", "roles": {role: {"ranks", "start_seconds", "seconds", "spans": {name:
    [self CPU seconds]}, "tokens_per_s", "metrics": {name: [the interval's mean over the ranks that recorded it, or
    None]}, "metric_seconds"}}, "metric_source", "gpus": {gpu: {"seconds", "headroom_bytes", "total_bytes"}}};
    "seconds" since the run started, at each window's end ("start_seconds": where the first began), in time order.
    Spans and tokens/s are per tick window where the run wrote ticks (`source` "ticks", typically `window_s`
    long), else per interval; the training metrics likewise where the ticks carry them (`metric_source`; ticks
    written before they did: the intervals'); the GPU headroom is the interval records' own."""
    starts = [s for log in run.ranks.values() for s in map(views.run_start, log.run_starts) if s.time_unix]
    t0 = start_unix(run)
    step = next((s.interval_s for s in starts if s.interval_s), None) or 60.0
    ticks = all(log.tick_windows for log in run.ranks.values()) and bool(run.ranks)
    tick_metrics = ticks and any(views.interval(w).metrics for log in run.ranks.values() for w in log.tick_windows)
    roles: dict = {}
    for role, logs in sorted(run.by_role().items()):
        roles[role] = _series(_bins([log.tick_windows if ticks else log.intervals for log in logs], t0), len(logs))
        metrics = _series(_bins([log.tick_windows if tick_metrics else log.intervals for log in logs], t0), len(logs))
        roles[role]["metrics"], roles[role]["metric_seconds"] = metrics["metrics"], metrics["seconds"]
    durations = sorted(views.interval(r).duration_seconds or 0.0 for log in run.ranks.values()
                       for r in log.tick_windows)
    return {"interval_s": step, "source": "ticks" if ticks else "intervals",
            "window_s": durations[len(durations) // 2] if ticks else step, "roles": roles,
            "metric_source": "ticks" if tick_metrics else "intervals",
            "gpus": _headroom(run, t0)}


def start_unix(run: Run) -> float:
    """When the run started (its earliest run_start, else its earliest interval), Unix seconds: the origin of every
    series' "seconds since the run started"."""
    starts = [s.time_unix for log in run.ranks.values() for s in map(views.run_start, log.run_starts) if s.time_unix]
    return min(starts, default=None) or \
        min((r.time_unix for log in run.ranks.values() for r in map(views.interval, log.intervals)), default=0.0)


def _bins(windows_per_rank: list, t0: float) -> dict:
    """{k: the k-th window of every rank of a role}: ranks start a little apart, and a final, partial window
    must not fold into the one before it."""
    bins: dict = {}
    for windows in windows_per_rank:
        for k, rec in enumerate(map(views.interval, windows)):
            b = bins.setdefault(k, {"spans": {}, "tokens_per_s": 0.0, "seconds": [], "starts": [], "metrics": {}})
            b["seconds"].append(rec.time_unix - t0)
            b["starts"].append(rec.time_unix - t0 - (rec.duration_seconds or 0.0))
            for name, e in rec.spans.items():
                b["spans"][name] = b["spans"].get(name, 0.0) + e.self_seconds("cpu")
            b["tokens_per_s"] += rec.counters.entry("tokens").per_second or 0.0
            for name in TRAIN_METRICS:
                m = rec.metrics.entry(name)
                value = m.mean if m.mean is not None else m.last
                if value is not None:
                    b["metrics"].setdefault(name, []).append(value)
    return bins


def _headroom(run: Run, t0: float) -> dict:
    """{gpu: its headroom per interval record, in time order}: ranks sharing a GPU both sample it, so their
    points interleave in time (a line drawn in rank order would run backwards)."""
    points: dict = {}
    for log in run.ranks.values():
        for rec in map(views.interval, log.intervals):
            for g in rec.measured_gpus:
                if g.headroom_bytes is not None:
                    s = points.setdefault(gpu_key(log, g.raw), {"points": [], "total_bytes": g.total_bytes})
                    s["points"].append((rec.time_unix - t0, g.headroom_bytes))
    return {gpu: {"seconds": [t for t, _ in sorted(s["points"])], "headroom_bytes": [h for _, h in sorted(s["points"])],
                  "total_bytes": s["total_bytes"]} for gpu, s in points.items()}


def _series(bins: dict, ranks: int) -> dict:
    """A role's series from its bins, in the order of their times (the ranks' mean end of each bin)."""
    keys = sorted(bins, key=lambda k: (sum(bins[k]["seconds"]) / len(bins[k]["seconds"]), k))
    names = sorted({n for b in bins.values() for n in b["spans"]})
    return {"ranks": ranks, "start_seconds": min(bins[keys[0]]["starts"]) if keys else 0.0,
            "seconds": [sum(bins[k]["seconds"]) / len(bins[k]["seconds"]) for k in keys],
            "spans": {n: [bins[k]["spans"].get(n, 0.0) for k in keys] for n in names},
            "tokens_per_s": [bins[k]["tokens_per_s"] for k in keys],
            "metrics": {n: [sum(v) / len(v) if (v := bins[k]["metrics"].get(n)) else None for k in keys]
                        for n in TRAIN_METRICS if any(n in bins[k]["metrics"] for k in keys)}}


def _top_spans(spans: dict) -> list:
    """(label, values) for the TOP_SPANS largest spans and one "other" for the rest."""
    ranked = sorted(spans.items(), key=lambda kv: -sum(kv[1]))
    layers = list(ranked[:TOP_SPANS])
    rest = ranked[TOP_SPANS:]
    if rest:
        layers.append(("other", [sum(v) for v in zip(*(vals for _, vals in rest))]))
    return layers


def _time_unit(tl: dict) -> tuple[str, float]:
    """(unit name, seconds per unit) that keeps the run's length readable."""
    last = max((x for s in [*tl["roles"].values(), *tl["gpus"].values()] for x in s["seconds"]), default=0.0)
    return ("seconds", 1.0) if last < 600 else ("minutes", 60.0) if last < 5 * 3600 else ("hours", 3600.0)


def _line_style(n_points: int) -> dict:
    return {"marker": ".", "markersize": 4} if n_points <= 120 else {"linewidth": 0.8}


def _plot_role(ax, role: str, s: dict, per: float, colors: dict, window: str) -> None:
    """Steps drawn "pre" from each interval's end back to the previous one's, and the first from where it
    began, so the first interval is drawn too."""
    layers = _top_spans(s["spans"])
    if layers:
        x = [t / per for t in [s["start_seconds"], *s["seconds"]]]
        ax.stackplot(x, *[[v[0], *v] for _, v in layers], labels=[n for n, _ in layers], step="pre",
                     colors=[colors.get(n, "0.6") for n, _ in layers])
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_ylabel(f"self CPU seconds\nper {window.split()[-1]}")
    ax.set_title(f"{role}: self CPU time (host wall, children left out) per {window}, stacked by "
                 f"span (sum over {s['ranks']} rank{'s' if s['ranks'] != 1 else ''})", fontsize=9, loc="left")


def panels(tl: dict) -> list:
    """(kind, key) of each panel the run has data for, top to bottom: a role's stacked spans, tokens/s, each
    training metric, GPU headroom."""
    out = [("role", role) for role, s in tl["roles"].items() if s["spans"]]
    if any(v for s in tl["roles"].values() for v in s["tokens_per_s"]):
        out.append(("tokens", None))
    out += [("metric", name) for name in TRAIN_METRICS if any(name in s["metrics"] for s in tl["roles"].values())]
    return out + ([("headroom", None)] if tl["gpus"] else [])


def plot_run(run: Run, png_path) -> str:
    """Write the PNG; returns its path. Needs matplotlib (the `test` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = timeline(run)
    unit, per = _time_unit(tl)
    names = sorted({n for s in tl["roles"].values() for n in s["spans"]})
    palette = plt.get_cmap("tab20").colors
    colors = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    shown = panels(tl) or [("empty", None)]
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 3.0 * len(shown)), sharex=True, squeeze=False)
    for ax, (kind, key) in zip(axes[:, 0], shown):
        if kind == "role":
            _plot_role(ax, key, tl["roles"][key], per, colors, _window_words(tl))
        elif kind == "tokens":
            _plot_tokens(ax, tl["roles"], per, _window_words(tl))
        elif kind == "metric":
            _plot_metric(ax, key, tl["roles"], per, _window_words(tl, tl["metric_source"]))
        elif kind == "headroom":
            _plot_headroom(ax, tl["gpus"], per)
        else:
            ax.text(0.5, 0.5, "no interval records", ha="center", va="center", transform=ax.transAxes)
    axes[-1, 0].set_xlabel(f"{unit} since the run started")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return str(png_path)


def _window_words(tl: dict, source: str | None = None) -> str:
    """What one point stands for: "5 s tick window" or "60 s interval" (`source`: the timeline's by default)."""
    source = source or tl["source"]
    return f"{tl['window_s'] if source == tl['source'] else tl['interval_s']:.2g} s " + \
        ("tick window" if source == "ticks" else "interval")


def _plot_tokens(ax, roles: dict, per: float, window: str) -> None:
    for role, s in roles.items():
        if any(s["tokens_per_s"]):
            ax.plot([t / per for t in s["seconds"]], s["tokens_per_s"], label=role, **_line_style(len(s["seconds"])))
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"tokens/s per role per {window} (sum over its ranks' rates)", fontsize=9, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def _plot_metric(ax, name: str, roles: dict, per: float, window: str) -> None:
    """One training metric per role that recorded it: each window's mean (of its ranks' window means)."""
    for role, s in roles.items():
        values = s["metrics"].get(name)
        if values:
            pts = [(t / per, v) for t, v in zip(s["metric_seconds"], values) if v is not None]
            ax.plot([x for x, _ in pts], [v for _, v in pts], label=role, **_line_style(len(pts)))
    ax.set_ylabel(name)
    ax.set_title(f"{TRAIN_METRICS[name]} per {window} (the mean of the values recorded in it, over the role's "
                 "ranks)", fontsize=9, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def _plot_headroom(ax, gpus: dict, per: float) -> None:
    ax.set_title("GPU memory headroom per interval (total minus the interval's peak used; dashed: 5% of the GPU)",
                 fontsize=9, loc="left")
    ax.set_ylabel("headroom GiB")
    for gpu, s in sorted(gpus.items()):
        line, = ax.plot([t / per for t in s["seconds"]], [h / GIB for h in s["headroom_bytes"]], label=f"gpu {gpu}",
                        **_line_style(len(s["seconds"])))
        if s["total_bytes"]:
            ax.axhline(0.05 * s["total_bytes"] / GIB, color=line.get_color(), linewidth=0.6, linestyle="--")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
