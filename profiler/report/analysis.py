"""The report's analyses of one run (a `report.runs.Run`), JSON-able: span_ranking, role_shares and verdict
(which side bounds the pipeline), bandwidth (against the floors), rank_table (per rank, the straggler).

Records are read through the run log's schema (docs/RUNLOG.md): profiler.schema.views where a few are read (a rank's
run_start or run_end, an interval with open spans), profiler.schema.windows' dict-speed accessors in the loops over every
interval, span entry and GPU.
"""
from __future__ import annotations

import statistics
from itertools import repeat

from profiler.schema import views
from profiler.schema.windows import (SpanSums, clock_block, clock_seconds, duration_seconds, entry_bytes, entry_counts,
                              entry_floor, gauge_mean, gpu_activity_percents, gpu_bound, interval_open_spans,
                              p50_p95_seconds, phase_seconds, profiler_share, span_clock, span_entries, steady_throughput,
                              steps_advanced, summed_mfu, whole_seconds, window_step, window_warmup)
from profiler.schema.span_kinds import COLLECTIVE, SpanKinds
from profiler.report.kernels import capture_busy
from profiler.report.runs import PIPELINE_ROLES, Run, counter_total, gpus, interval_window, merged_window, phase_spans, \
    span_kinds, steady_window, wall_seconds

WAIT_BOUND_SHARE = 0.15    # a role waiting this share of its time on the other side does not bound the pipeline
BALANCED_SHARE = 0.05      # neither role waits this much: the pipeline is balanced
STRAGGLER_GAP = 0.2        # a rank this much below its peers' median capacity is a straggler
NO_METER = "no throughput event (a run stopped during warm-up, or a log not written by this dflash-train)"
LOOP_NO_METER = ("no throughput meter (a loop of its own writes no throughput event; the steady state section gives "
                 "its steady intervals' rates)")


# ---- span ranking ----------------------------------------------------------------------------

def _histogram_quantile(bounds: list, counts: list, q: float, max_seconds: float) -> float | None:
    """Prometheus-style: linear inside the bucket holding the q-th observation; +Inf ends at the max seen."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen = q * total, 0.0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            lower = bounds[i - 1] if i > 0 else 0.0
            upper = bounds[i] if i < len(bounds) else max(max_seconds, lower)
            return min(lower + (upper - lower) * (rank - seen) / c, max_seconds)
        seen += c
    return max_seconds


def _weighted_quantile(pairs: list, q: float) -> float | None:
    """q-quantile of per-interval values weighted by their span counts (logs without buckets)."""
    pairs = sorted((v, w) for v, w in pairs if v is not None and w)
    total = sum(w for _, w in pairs)
    seen = 0.0
    for v, w in pairs:
        seen += w
        if seen >= q * total:
            return v
    return None


def _clamp(estimate: float | None, pairs: list) -> float | None:
    """The bucket interpolation (coarse inside a wide bucket) clamped to the range of the parts' quantiles."""
    values = [v for v, w in pairs if v is not None and w]
    if estimate is None or not values:
        return estimate
    return min(max(estimate, min(values)), max(values))


def _clock_parts(entries, on: str) -> list:
    """(clock block, how many spans its figures are over: gpu_count, else count, on the GPU) of each span entry
    timed on clock `on` (windows.SpanSums.stats' shape)."""
    parts = []
    for e in entries:
        block = clock_block(e, on)
        if block:
            count, timed, _ = entry_counts(e)
            parts.append((block, (timed or count or 0) if on == "gpu" else count or 0))
    return parts


def _quantiles(on: str, measured: SpanSums, ends: list | None, bounds: list | None, max_seconds: float) -> tuple:
    """(p50, p95, from) of a role's whole spans on clock `on` (`measured`: the windows.SpanSums of its interval
    entries on that clock). The parts are its ranks' run_end entries when every
    segment closed with one holding percentiles (exact over its segment), else its intervals'. One part: its own
    percentiles, exact, as the console's end-of-run table shows them. Several: the intervals' summed histogram
    buckets interpolated, clamped to the range of the parts' own percentiles (a mixture's quantile lies in it);
    logs without buckets take the count-weighted quantile of the parts' percentiles."""
    parts = _clock_parts(ends or (), on)
    p50s, p95s = p50_p95_seconds(parts)
    if not parts or any(p95 is None for p95, _ in p95s):   # run_ends of older logs
        parts = measured.stats
        p50s, p95s = p50_p95_seconds(parts)
    if len(parts) == 1:
        return p50s[0][0], p95s[0][0], "exact"
    buckets = measured.buckets
    summed = _column_sums(buckets) if bounds and buckets and all(
        type(b) is list and len(b) == len(bounds) + 1 for b in buckets) else None
    if summed is not None:
        p50 = _clamp(_histogram_quantile(bounds, summed, 0.50, max_seconds), p50s)
        p95, source = _clamp(_histogram_quantile(bounds, summed, 0.95, max_seconds), p95s), "histogram"
    else:
        p50, p95, source = _weighted_quantile(p50s, 0.50), _weighted_quantile(p95s, 0.95), "weighted percentiles"
    if p50 is not None and p95 is not None and p95 < p50:   # order statistics stay ordered (coarse buckets)
        p95 = p50
    return p50, p95, source


def _column_sums(rows: list) -> list | None:
    """The column sums of equal-length rows of bucket counts, or None where a count is not a number."""
    import numpy as np   # a million rows in a week-long log's span: a column sum in C

    counts = np.asarray(rows)
    return counts.sum(axis=0).tolist() if counts.dtype.kind in "biuf" else None


def _span_row(role: str, name: str, a: dict, role_wall: float, bounds: list | None, busy: tuple = (None, None),
              wait: bool = False) -> dict:
    """One ranked span from its entries in every interval of the role's ranks (and their run_ends'); `busy`:
    (the captures' busy share of the span, the role's GPM SM active percent), the estimates beside its class;
    `wait`: whether the role waits on the other side in it (the run's span table)."""
    entries = a["entries"]
    on = span_clock(entries)
    sums = SpanSums(entries, on)
    n = sum(w for _, w in sums.stats)
    # the longest of the intervals' and of the run_ends' (a segment's whole figures hold the spans of intervals the
    # log could not take, a full disk's): the p95 read from the run_ends never passes it
    max_seconds = max([0.0] + sums.longest_seconds
                      + [views.SpanEntry.of(e).clock(on).max_seconds or 0.0 for e in a["ends"] or ()])
    p50, p95, source = _quantiles(on, sums, a["ends"], bounds, max_seconds)
    timed = sums.timed > 0
    return {"role": role, "span": name, "count": sums.count, "on": on,
            "total_seconds": sums.total, "self_seconds": sums.self_total, "cpu_seconds": sums.cpu,
            "gpu_window_seconds": sums.gpu_window if timed else None,
            "gpu_bound": gpu_bound(sums.lags, *busy), "gpu_timed": sums.timed_spans if timed else None,
            "share": sums.total / role_wall if role_wall > 0 else None,
            "mean_seconds": (sums.gpu_sum if on == "gpu" else sums.whole) / n if n else None,
            "p50_seconds": p50, "p95_seconds": p95, "max_seconds": max_seconds, "quantiles_from": source,
            "intervals": len(entries), "wait": wait, "ranks": sorted(a["ranks"]),
            **{k: a[k] for k in ("open_intervals", "open_max_seconds", "open_where", "open_at_end")}}


def _add_open(agg: dict, role: str, log, rec: dict) -> None:
    """Note the spans open when an interval closed: how many ends, the longest (where), open at the log's end."""
    interval = views.interval(rec)
    for name, opened in interval.open_at_end.items():
        a = agg.get((role, name))
        if a is None:   # a log written before open spans held time in the interval
            continue
        thread, age_s = opened[0]
        a["open_intervals"] += 1
        if a["open_max_seconds"] is None or age_s > a["open_max_seconds"]:
            a["open_max_seconds"] = age_s
            a["open_where"] = {"rank": log.rank, "interval": interval.index, "thread": thread}
        if rec is log.intervals[-1]:
            a["open_at_end"] = True


def span_ranking(run: Run, top: int | None = None) -> dict:
    """Spans per role ranked by total time; share = over the role's ranks' summed interval time. Count,
    mean and quantiles are of whole spans; open_* say how often, how long and where a span was open at an end."""
    bounds = run.histogram_bounds_seconds()
    roles, agg = {}, {}
    for role, logs in run.by_role().items():
        roles[role] = {"ranks": [log.rank for log in logs],
                       "wall_seconds": sum(wall_seconds(log.intervals) for log in logs)}
        closed = all(log.run_ends and len(log.run_ends) == len(log.run_starts) for log in logs)
        for log in logs:
            for rec in log.intervals:
                for name, entry in span_entries(rec).items():
                    acc = agg.get((role, name))
                    if acc is None:
                        acc = agg[(role, name)] = {"entries": [], "ranks": set(), "open_intervals": 0,
                                                   "open_max_seconds": None, "open_where": None,
                                                   "open_at_end": False, "ends": [] if closed else None}
                    acc["entries"].append(entry)
                    acc["ranks"].add(log.rank)
                if interval_open_spans(rec):
                    _add_open(agg, role, log, rec)
        for name, e in ((n, e) for log in logs for end in log.run_ends for n, e in span_entries(end).items()):
            if closed and (role, name) in agg:
                agg[(role, name)]["ends"].append(e)
    sm, captured, kinds = sm_active_by_role(run), capture_busy(run), span_kinds(run)
    rows = [_span_row(role, name, a, roles[role]["wall_seconds"], bounds, (captured.get((role, name)), sm.get(role)),
                      kinds.is_wait(name, role)) for (role, name), a in agg.items()]
    rows.sort(key=lambda r: -r["total_seconds"])
    return {"rows": rows[:top] if top else rows, "spans_total": len(rows), "roles": roles}


def sm_active_by_role(run: Run) -> dict:
    """{role: GPM SM active percent, the mean over every interval x GPU of its ranks that has it} (the spans
    table's window: the whole run)."""
    out = {}
    for role, logs in run.by_role().items():
        values = [sm for log in logs for rec in log.intervals for g in gpus(rec)
                  if (sm := gpu_activity_percents(g)[1]) is not None]
        if values:
            out[role] = statistics.fmean(values)
    return out


# ---- verdict ---------------------------------------------------------------------------------

def _span_seconds(intervals: list, names, on: str | None = None) -> float:
    """The seconds of spans `names` over `intervals`, each name on clock `on`, else on its one clock
    (windows.span_clock)."""
    total = 0.0
    for name in names:
        entries = [spans[name] for spans in map(span_entries, intervals) if name in spans]
        clock = on or span_clock(entries)   # once per name: per entry it made the report quadratic in the intervals
        total += sum(map(clock_seconds, entries, repeat(clock)), 0.0)
    return total


def _wait_share(intervals: list, role: str, kinds: SpanKinds) -> float | None:
    """The share of `intervals`' wall time the role waits on the other side (its wait spans in `kinds`); None for
    a role that has none (a loop of its own waits on no other role). A wait is the host's: read on the CPU clock,
    cut at the windows' edges. (A wait span's GPU window, scaled from its timed instances to all of them, could
    read over 100% of the wall: the H100 run of 2026-12-07 printed "target waits 101%".)"""
    waits = [n for n, r in kinds.waits().items() if r == role]
    wall = wall_seconds(intervals)
    return _span_seconds(intervals, waits, "cpu") / wall if wall > 0 and waits else None


def role_shares(run: Run) -> dict:
    """{role: {wait_span, wait_share, busy_share, wall_seconds, tokens, window, steady}} over the steady window of
    the role's ranks (runs.merged_window, named by `window`); busy = 1 - wait (the run's wait spans, span_kinds)."""
    out, kinds = {}, span_kinds(run)
    waits = kinds.waits()
    for role, logs in run.by_role().items():
        w = merged_window(logs)
        wait = _wait_share(w.intervals, role, kinds)
        out[role] = {"wait_span": ", ".join(sorted(n for n, r in waits.items() if r == role)) or None,
                     "wait_share": wait, "busy_share": None if wait is None else max(0.0, 1.0 - wait),
                     "wall_seconds": wall_seconds(w.intervals), "tokens": counter_total(w.intervals, "tokens"),
                     "window": w.label, "steady": not w.fallback}
    return out


# A GPU NVML calls this busy (some kernel running in nearly every sample period) ...
GPU_BUSY_PERCENT = 90.0
# ... while GPM sees its SMs and tensor pipes mostly idle waits on the host's kernel launches: launch-bound.
LAUNCH_BOUND_SM_PERCENT = 50.0
LAUNCH_BOUND_TENSOR_PERCENT = 20.0
GPM_FIELDS = ("util_percent_mean", "sm_active_percent_mean", "tensor_active_percent_mean", "dram_active_percent_mean")
"""The GPU fields gpu_activity averages: windows.gpu_activity_percents' in its order, named as the log and the
report's output name them."""


def gpu_activity(run: Run) -> dict:
    """{role: NVML utilisation and GPM activity, means over the role's steady window (named by `window`) where GPM
    measured, and `bound`}: a GPU busy by NVML (>= GPU_BUSY_PERCENT) whose SMs and tensor pipes are mostly idle
    is `launch-bound` (the host's launches set the pace), not compute-bound; {} without GPM (no GPU, pre-Hopper)."""
    out = {}
    for role, logs in run.by_role().items():
        w = interval_window(logs)   # NVML and GPM are sampled per interval only
        rows = [p for rec in w.intervals for g in gpus(rec)
                if (p := gpu_activity_percents(g))[2] is not None and p[0] is not None]   # tensor, NVML busy
        if not rows:
            continue
        means = {f: statistics.fmean(p[i] for p in rows) if all(p[i] is not None for p in rows) else None
                 for i, f in enumerate(GPM_FIELDS)}
        sm, tensor = means["sm_active_percent_mean"], means["tensor_active_percent_mean"]
        launch = (means["util_percent_mean"] >= GPU_BUSY_PERCENT and tensor < LAUNCH_BOUND_TENSOR_PERCENT
                  and (sm is None or sm < LAUNCH_BOUND_SM_PERCENT))
        out[role] = {**means, "samples": len(rows), "window": w.label, "bound": "launch-bound" if launch else None}
    return out


def _gpu_evidence(activity: dict) -> list:
    lines = []
    for role, a in activity.items():
        said = (f"{role} GPUs (GPM, {a['samples']} interval x GPU means; {a['window']}): NVML busy "
                f"{a['util_percent_mean']:.0f}%, SMs active {_pct(a['sm_active_percent_mean'])}, tensor pipes "
                f"{_pct(a['tensor_active_percent_mean'])}, DRAM bandwidth {_pct(a['dram_active_percent_mean'])}")
        if a["bound"] == "launch-bound":
            said += (": launch-bound, not compute-bound (a kernel is always running but few SMs and little tensor "
                     "work: larger batches, fused kernels or CUDA graphs, not a faster GPU)")
        lines.append(said)
    return lines


def _pct(percent) -> str:
    return "-" if percent is None else f"{percent:.0f}%"


def verdict(run: Run) -> dict:
    """The pipeline's verdict (_pipeline_verdict) and, where GPM measured the GPUs, what bounds each role's GPUs
    (`gpu`, and an evidence line per role: a launch-bound GPU is not made faster by more compute)."""
    out = _pipeline_verdict(run)
    out["gpu"] = gpu_activity(run)
    out["evidence"] += _gpu_evidence(out["gpu"])
    return out


def _pipeline_verdict(run: Run) -> dict:
    """Which side bounds the pipeline, from the wait shares: the drafter starving on drafter.recv means
    target-bound, the target blocked on transfer.wait_slot drafter-bound, both waiting transfer-bound."""
    shares = role_shares(run)
    if not run.pipeline:   # a loop of its own: no target and drafter to weigh
        return {"verdict": None, "applies": False, "roles": shares, "queue_depth_mean": None, "evidence": []}
    wt = (shares.get("target") or {}).get("wait_share")
    wd = (shares.get("drafter") or {}).get("wait_share")
    drafters = interval_window(run.by_role().get("drafter", []))   # gauges: interval records only
    depths = [m for r in drafters.intervals if (m := gauge_mean(r, "queue_depth")) is not None]
    out = {"verdict": None, "applies": True, "roles": shares,
           "queue_depth_mean": statistics.fmean(depths) if depths else None, "evidence": []}
    if wt is None or wd is None:
        out["evidence"].append("needs the intervals of both a target and a drafter rank")
        return out
    idle = [f"{role} ({s['window']})" for role, s in shares.items() if not s["tokens"]]
    if idle:
        out["evidence"].append(f"no tokens processed by the {' and '.join(idle)}: stalled, or still starting "
                               "(finished spans cannot tell which side bounds it)")
        return out
    said = (f"target waits {wt:.0%} on {shares['target']['wait_span']}, drafter waits {wd:.0%} on "
            f"{shares['drafter']['wait_span']}")
    if wt >= WAIT_BOUND_SHARE and wd >= WAIT_BOUND_SHARE:
        out["verdict"] = "transfer-bound"
        out["evidence"].append(f"{said}: both sides wait, so batches are slow in between")
    elif max(wt, wd) < BALANCED_SHARE:
        out["verdict"] = "balanced"
        out["evidence"].append(f"{said}: neither side waits {BALANCED_SHARE:.0%} of its time")
    elif wd > wt:
        out["verdict"] = "target-bound"
        out["evidence"].append(f"{said}: the drafter starves")
    else:
        out["verdict"] = "drafter-bound"
        out["evidence"].append(f"{said}: the target is held back by transfer slots the drafter frees")
    if depths:
        out["evidence"].append(f"received batches waiting for the drafter: {out['queue_depth_mean']:.2f} on average "
                               f"({len(depths)} interval mean{'s' if len(depths) != 1 else ''}; drafter: "
                               f"{drafters.label})")
    return out


# ---- bandwidth -------------------------------------------------------------------------------

def _bandwidth_row(role: str, name: str, pairs: list) -> dict:
    """One byte-moving span from its (interval entry, run's floors) pairs: the seconds are of the whole spans
    that moved the bytes; the floor is the last one named."""
    floor = floor_bps = None
    for e, floors in pairs:
        named, named_bps = entry_floor(e)
        floor = named or floor
        floor_bps = named_bps or floors.get(floor) or floor_bps
    moved_bytes = sum(entry_bytes(e) for e, _ in pairs)
    seconds = sum((whole_seconds(e) for e, _ in pairs), 0.0)
    achieved = moved_bytes / seconds if seconds > 0 else None
    at_floor = moved_bytes / floor_bps if floor_bps else None
    return {"role": role, "span": name, "bytes": moved_bytes, "seconds": seconds, "bandwidth_bytes_per_s": achieved,
            "floor": floor, "floor_bytes_per_s": floor_bps,
            "floor_ratio": achieved / floor_bps if achieved and floor_bps else None, "seconds_at_floor": at_floor,
            "seconds_over_floor": seconds - at_floor if at_floor is not None else None}


def bandwidth(run: Run) -> list:
    """Per (role, span) that declares bytes: bytes moved, seconds, achieved bytes/s, its floor and the
    ratio, and the seconds it would have taken at the floor. Sorted by the seconds lost to the floor."""
    moved: dict = {}
    for log in run.ranks.values():
        floors = next((f for f in (views.run_start(s).floors for s in log.run_starts) if f), {})
        for rec in log.intervals:
            for name, e in span_entries(rec).items():
                if entry_bytes(e):
                    moved.setdefault((log.role, name), []).append((e, floors))
    rows = [_bandwidth_row(role, name, pairs) for (role, name), pairs in moved.items()]
    rows.sort(key=lambda r: -(r["seconds_over_floor"] or 0.0))
    return rows


# ---- ranks and the straggler -----------------------------------------------------------------

def _rank_row(log, kinds: SpanKinds) -> dict:
    """One rank. Each figure beside the window it was read over: `tokens_per_s` is the steady state's
    (steady_tokens_per_s, its throughput events, over `tokens_window_seconds`), or, for a loop of its own without
    a meter, its steady intervals' (`tokens` counter over their wall, as the steady line reads it); busy share,
    `window_tokens_per_s` and capacity (that rate over the work share) are all over its steady intervals
    (`window`, `window_seconds`)."""
    w = steady_window(log)
    wall, wait = wall_seconds(w.intervals), _wait_share(w.intervals, log.role, kinds)
    collective = _span_seconds(w.intervals, kinds.names(COLLECTIVE)) / wall if wall > 0 else None
    meter = steady_throughput(log.events)
    window_rate = counter_total(w.intervals, "tokens") / wall if wall > 0 else None
    own_loop = meter is None and log.role not in PIPELINE_ROLES and bool(window_rate)
    work = None if wait is None else max(0.0, 1.0 - wait - collective)
    stalled = _trailing_idle(log.intervals)
    return {"rank": log.rank, "role": log.role, "host": log.hostname, "intervals": len(log.intervals),
            "stalled_intervals": len(stalled), "stalled_seconds": wall_seconds(stalled),
            "steady_tokens_per_s": meter["steady_tokens_per_s"] if meter else None,
            "steady_reason": None if meter else NO_METER if log.role in PIPELINE_ROLES else LOOP_NO_METER,
            **_tokens_window(meter, window_rate if own_loop else None, w.label, wall),
            "window": w.label, "window_seconds": wall, "window_tokens_per_s": window_rate,
            "wait_share": wait, "collective_share": collective,
            "busy_share": None if wait is None else 1.0 - wait, "work_share": work,
            "capacity_tokens_per_s": window_rate / work if window_rate and work and not w.fallback else None,
            "steps": max((window_step(r) or 0 for r in log.intervals), default=None),
            "status": views.run_end(log.run_ends[-1]).status if log.run_ends else "no run_end",
            "bad_lines": log.bad_lines,
            "span_seconds_per_token": _span_seconds_per_token(w.intervals, counter_total(w.intervals, "tokens")),
            **_profiler_row(log)}


def _profiler_row(log) -> dict:
    """The profiler's share and the window it was read over: the rank's steady intervals (the interval records
    carry it; tick windows do not)."""
    w = interval_window([log])
    return {"profiler_share": _profiler_share(w.intervals), "profiler_window": w.label}


def _tokens_window(meter: dict | None, loop_rate: float | None, label: str, wall: float) -> dict:
    """The rank table's tokens/s with the window it is over: the meter's steady state, else a loop's steady
    intervals, else none (None: the row shows "-")."""
    if meter and meter["steady_tokens_per_s"] is not None:
        return {"tokens_per_s": meter["steady_tokens_per_s"], "tokens_window": "steady state",
                "tokens_window_seconds": meter["steady_seconds"]}
    if loop_rate is not None:
        return {"tokens_per_s": loop_rate, "tokens_window": label, "tokens_window_seconds": wall}
    return {"tokens_per_s": None, "tokens_window": None, "tokens_window_seconds": None}


def _profiler_share(intervals: list) -> float | None:
    """The profiler's threads' CPU over wall time across `intervals` (duration-weighted), or None without it."""
    measured = [r for r in intervals if profiler_share(r) is not None]
    wall = wall_seconds(measured)
    return sum(profiler_share(r) * duration_seconds(r) for r in measured) / wall if wall > 0 else None


def _trailing_idle(intervals: list) -> list:
    """The rank's last intervals in which no span finished (a stall, unless the run ended there)."""
    idle = []
    for rec in reversed(intervals):
        interval = views.interval(rec)
        if any(e.count for e in interval.spans.values()) or interval.final:
            break
        idle.append(rec)
    return idle


def _span_seconds_per_token(intervals: list, tokens: float) -> dict:
    """{span: its seconds over `intervals` (_span_seconds) per token}, spans in the order they first appear."""
    if not tokens:
        return {}
    by_name: dict = {}
    for r in intervals:
        for n, e in span_entries(r).items():
            by_name.setdefault(n, []).append(e)
    return {n: (0.0 + sum(map(clock_seconds, entries, repeat(span_clock(entries))), 0.0)) / tokens
            for n, entries in by_name.items()}


def _straggler(rows: list, kinds: SpanKinds) -> dict | None:
    """The rank whose capacity (tokens/s over its work share) is over STRAGGLER_GAP below its role's other
    ranks' median, with the span that costs it most."""
    worst = None
    for row in rows:
        peers = [p["capacity_tokens_per_s"] for p in rows if p["role"] == row["role"] and p is not row
                 and p["capacity_tokens_per_s"]]
        if not peers or not row["capacity_tokens_per_s"]:
            continue
        median = statistics.median(peers)
        slowdown = row["capacity_tokens_per_s"] / median
        if slowdown < 1.0 - STRAGGLER_GAP and (worst is None or slowdown < worst["capacity_ratio"]):
            worst = {"rank": row["rank"], "role": row["role"], "capacity_tokens_per_s": row["capacity_tokens_per_s"],
                     "peers_median_tokens_per_s": median, "capacity_ratio": slowdown, "window": row["window"],
                     **_costliest_span(row, rows, kinds)}
    return worst


def _costliest_span(row: dict, rows: list, kinds: SpanKinds) -> dict:
    mine = row["span_seconds_per_token"]
    best, excess_best = None, 0.0
    not_own = set(kinds.waits()) | set(kinds.names(COLLECTIVE))   # waits on others, lock-step with peers
    for name, spt in mine.items():
        if name in not_own:
            continue
        peers = [p["span_seconds_per_token"].get(name, 0.0) for p in rows if p["role"] == row["role"] and p is not row]
        excess = spt - statistics.median(peers)
        if excess > excess_best:
            best, excess_best = {"span": name, "span_seconds_per_token": spt,
                                 "peers_span_seconds_per_token": statistics.median(peers)}, excess
    return best or {"span": None}


def rank_table(run: Run) -> dict:
    """{"ranks": per-rank rows (_rank_row), "straggler": the slow rank or None, "reason"}."""
    kinds = span_kinds(run)
    rows = [_rank_row(log, kinds) for log in run.ranks.values()]
    multi = any(sum(1 for r in rows if r["role"] == role) >= 2 for role in {r["role"] for r in rows})
    measured = any(r["capacity_tokens_per_s"] for r in rows)
    return {"ranks": rows, "straggler": _straggler(rows, kinds),
            "reason": None if multi and measured else "no role has two ranks to compare" if not multi else
            "no rank has a capacity to compare (its steady intervals' tokens/s over its work share)"}


# ---- the steady state ------------------------------------------------------------------------

def steady_state(run: Run) -> dict:
    """{"steady_tokens_per_s": the drafters' summed rate, "roles": {role: ...}}: a role's rate sums its ranks'
    throughput meters (dflash/throughput.py); beside it the phases' self time and the warm-up windows' (_warmup)."""
    phases = phase_spans(run)
    roles: dict = {}
    for role, logs in run.by_role().items():
        meters = [(log.rank, steady_throughput(log.events)) for log in logs]
        got = [m for _, m in meters if m and m["steady_tokens_per_s"] is not None]
        compute = [(m["steady_model_flops_per_s"], _peaks(log)) for (_, m), log in zip(meters, logs)
                   if m and m["steady_model_flops_per_s"] is not None]
        roles[role] = {"window": "steady state", "ranks": [r for r, _ in meters],
                       "ranks_measured": len(got),
                       "steady_tokens_per_s": sum(m["steady_tokens_per_s"] for m in got) if got else None,
                       "steady_seconds": max((m["steady_seconds"] for m in got), default=None),
                       "steady_steps": sum(m["steady_steps"] for m in got) if got else None,
                       "steady_model_flops_per_s": sum(r for r, _ in compute) if compute else None,
                       "mfu": summed_mfu(compute), "peaks": _role_peaks(logs),
                       "phases_seconds": phase_seconds([r for log in logs for r in log.intervals], phases),
                       **_warmup(logs),
                       "segments": max((m["segments"] for m in got), default=0),
                       "reason": None if got else NO_METER if role in PIPELINE_ROLES else LOOP_NO_METER}
        if not got and role not in PIPELINE_ROLES:
            roles[role]["intervals"] = interval_rates(logs)
    drafter = roles.get("drafter") or {}
    return {"steady_tokens_per_s": drafter.get("steady_tokens_per_s"), "window": "steady state",
            "roles": roles, "phase_spans": list(phases)}


def _peaks(log) -> dict:
    """The rank's compute peaks (its last run_start's), MFU's denominators."""
    return views.run_start(log.run_starts[-1]).compute_peaks if log.run_starts else {}


def _role_peaks(logs: list) -> dict:
    """{peak: what it is} of a role's ranks (the first rank's wording of each), for the MFU's label."""
    out = {}
    for log in logs:
        for name, p in _peaks(log).items():
            if isinstance(p, dict):
                out.setdefault(name, views.ComputePeak.of(p).what)
    return out


def _warmup(logs: list) -> dict:
    """{"warmup_seconds", "warmup_from"}: the wall time of the ranks' warm-up windows, their tick windows where
    every rank wrote ticks (as fine as the steady windows beside them), else their intervals."""
    ticks = all(log.tick_windows for log in logs)
    windows = [r for log in logs for r in (log.tick_windows if ticks else log.intervals)]
    return {"warmup_seconds": wall_seconds([r for r in windows if window_warmup(r)]),
            "warmup_from": "tick windows" if ticks else "intervals"}


def interval_rates(logs: list) -> dict:
    """A role's rates over its ranks' steady windows (runs.merged_window, named by `window`), from the interval
    records, for a loop without a throughput meter: tokens/s summed over its ranks (each rank's `tokens` counter over
    its window's wall time), steps/s the ranks' mean (`step_rate`: the steps its set_step advanced)."""
    w = merged_window(logs, ticks=False)   # step_rate: interval records only
    tokens, steps = [], []
    for log in logs:
        mine = steady_window(log, ticks=False).intervals
        wall = wall_seconds(mine)
        if wall > 0:
            tokens.append(counter_total(mine, "tokens") / wall)
            counted = [r for r in mine if steps_advanced(r) is not None]
            if counted and wall_seconds(counted) > 0:
                steps.append(sum(steps_advanced(r) for r in counted) / wall_seconds(counted))
    return {"window": w.label, "seconds": wall_seconds(w.intervals), "ranks": len(logs),
            "tokens_per_s": sum(tokens) if any(tokens) else None,
            "steps_per_s": statistics.fmean(steps) if steps else None}
