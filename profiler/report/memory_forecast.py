"""The memory forecast (docs/REPORT.md `memory_forecast`): per setting that scales a step's sizes (run_start
`memory_sizes`: dflash-train's --tokens-per-batch, --max-length and --num-anchors), the largest value that keeps
HEADROOM_SHARE of every GPU free, from the run's own per-step allocator peaks (interval `memory.steps`,
profiler/memory_steps.py), at most the run's value of the setting run_start `memory_caps` names for it.

Per rank, from the steps past warm-up that named their sizes:
- fixed bytes: the median of what stayed allocated once a step ended (weights, optimizer state, staged batches);
- a step's own bytes: its peak allocated minus the fixed bytes. Where all of a rank's sizes scale with the
  setting as one power, the worst step's own bytes scale with it: need(s) = fixed + max over steps of own *
  s^exponent, s the setting over its value in the run. Otherwise a non-negative least-squares fit through the
  origin splits a step's own bytes between its sizes, each part scaled by s to its size's own power (s^0 for a
  size the setting does not scale), and the worst step's residual above the fit is added back (the forecast
  bounds every step seen); a rank none of whose sizes scale keeps its worst step's peak;
- the transient: the highest peak of a warm-up step (compilation, autotune: the seeds' OOM), which scales with
  the step's as its ratio to the steady need at the run's setting when it is above it, and is named as binding.
Per GPU (ranks on one GPU add): the limit is (1 - HEADROOM_SHARE) of its NVML total less what is used outside the
ranks' allocators (NVML used at an interval's close less the ranks' reserved bytes then: CUDA contexts, NCCL,
libraries). The largest setting is found by bisection on the summed need, the smallest over GPUs.

A forecast that cannot be trusted says why in `reason`, with no number: no per-step peaks (a CPU run, a log
written before them), no sizes the loop named, too few steps past warm-up, no NVML total.
"""
from __future__ import annotations

import statistics

from profiler.schema import views
from profiler.report.runs import Run, gpu_key

HEADROOM_SHARE = 0.05
MIN_STEPS = 8          # steps past warm-up with sizes a rank needs before its model is trusted
MAX_SCALE = 1024.0     # the bisection's upper end (a setting 1024 times the run's)


def memory_forecast(run: Run) -> dict:
    """{"headroom_share", "settings": [per setting: {"flag", "current", "largest", "scale", "need_bytes_at_current",
    "limit_bytes", "limited_by", "transient"}], "ranks": [per rank model], "reason"}."""
    out = {"headroom_share": HEADROOM_SHARE, "settings": [], "ranks": [], "reason": None}
    sizes = next((views.run_start(s).memory_sizes for log in run.ranks.values() for s in reversed(log.run_starts)
                  if views.run_start(s).memory_sizes), {})
    models = [m for log in run.ranks.values() if (m := rank_model(log))]
    if not models:
        out["reason"] = ("no per-step allocator peaks: a CPU run, or a log written before them"
                         if not _any_cuda(run) else "no step of any rank recorded its allocator peak")
        return out
    if not sizes:
        out["reason"] = "the loop names no sizes (profiler.memory_sizes): nothing to scale the steps' peaks with"
        return out
    out["ranks"] = [_public(m) for m in models]
    short = [m for m in models if m["steps"] < MIN_STEPS]
    if short:
        out["reason"] = (f"too few steps past warm-up to forecast from: rank {short[0]['rank']} has "
                         f"{short[0]['steps']} (at least {MIN_STEPS})")
        return out
    gpus = _gpus(models)
    if not gpus:
        out["reason"] = "no GPU's total memory was measured (NVML)"
        return out
    caps = next((views.run_start(s).memory_caps for log in run.ranks.values() for s in reversed(log.run_starts)
                 if views.run_start(s).memory_caps), {})
    for flag in sorted({flag for size in map(views.MemorySize.of, sizes.values()) for flag in size.scales}):
        out["settings"].append(_setting(run, flag, sizes, models, gpus, caps.get(flag)))
    return out


def _any_cuda(run: Run) -> bool:
    return any(views.interval(r).memory.allocator.available for log in run.ranks.values() for r in log.intervals[:3])


def rank_model(log) -> dict | None:
    """One rank's steps: fixed bytes, its steady rows (sizes, own bytes), the warm-up's highest peak and the GPU
    it is on (with NVML total and the outside-allocator bytes at its last interval); None without step rows."""
    steady, warm = [], None
    for rec in log.intervals:
        iv = views.interval(rec)
        part = iv.memory.steps
        if part is None:
            continue
        for row in part.rows:
            peak = row.peak_allocated_bytes
            if peak is None:
                continue
            if iv.warmup or not row.sizes:
                if warm is None or peak > warm[1]:
                    warm = (row.step, peak)
            elif row.allocated_bytes is not None:
                steady.append(row)
    if not steady and warm is None:
        return None
    fixed = statistics.median(r.allocated_bytes for r in steady) if steady else 0.0
    gpu = _rank_gpu(log)
    worst = max(steady, key=lambda r: r.peak_allocated_bytes, default=None)
    ratio = (worst.peak_reserved_bytes / worst.peak_allocated_bytes
             if worst is not None and worst.peak_reserved_bytes and worst.peak_allocated_bytes else None)
    return {"rank": log.rank, "role": log.role, "steps": len(steady), "fixed_bytes": fixed,
            "rows": [(dict(r.sizes), max(0.0, r.peak_allocated_bytes - fixed)) for r in steady],
            "warm_peak": warm, "reserved_ratio": ratio, **gpu}


def _rank_gpu(log) -> dict:
    """The rank's GPU (host:index of its first NVML entry), its total, and NVML used less this rank's reserved
    bytes at its last interval with both (None where not measured)."""
    for rec in reversed(log.intervals):
        mem = views.interval(rec).memory
        gpus = mem.measured_gpus
        if gpus and gpus[0].total_bytes and mem.allocator.reserved_bytes is not None:
            g = gpus[0]
            return {"gpu": gpu_key(log, g.raw), "total_bytes": g.total_bytes,
                    "used_bytes": g.used_bytes_last, "reserved_bytes": mem.allocator.reserved_bytes}
    return {"gpu": None, "total_bytes": None, "used_bytes": None, "reserved_bytes": None}


def _gpus(models: list) -> dict:
    """{gpu: {"total_bytes", "outside_bytes", "ranks"}} for the GPUs NVML measured."""
    gpus: dict = {}
    for m in models:
        if m["gpu"] is None:
            continue
        g = gpus.setdefault(m["gpu"], {"total_bytes": m["total_bytes"], "used_bytes": m["used_bytes"] or 0,
                                       "reserved_bytes": 0, "ranks": []})
        g["used_bytes"] = max(g["used_bytes"], m["used_bytes"] or 0)
        g["reserved_bytes"] += m["reserved_bytes"] or 0
        g["ranks"].append(m["rank"])
    for g in gpus.values():
        g["outside_bytes"] = max(0.0, g["used_bytes"] - g["reserved_bytes"])
    return gpus


def need_fn(model: dict, flag: str, sizes: dict) -> tuple:
    """(need(s), basis, binding): the rank's bytes at the setting `flag` scaled by s (its steady model, the
    transient where above it), the model's basis in words, and whether the warm-up's transient binds."""
    described = {n: views.MemorySize.of(e) for n, e in sizes.items()}
    exps = {n: size.exponent(flag) for n, size in described.items()
            if size.exponent(flag) is not None and size.role in (None, model["role"])}
    rows, fixed = model["rows"], model["fixed_bytes"]
    named = {n for r, _ in rows for n in r}
    if not rows or not (named & set(exps)):
        worst = max([fixed + own for _, own in rows] or [model["warm_peak"][1]])
        return (lambda s: worst), "does not scale with it", False
    if named <= set(exps) and len({exps[n] for n in named}) == 1:
        worst, exponent = max(own for _, own in rows), exps[next(iter(named))]
        steady = lambda s: fixed + worst * s ** exponent   # noqa: E731
        basis = "every size it names scales with it" + (f" (as its power {exponent:g})" if exponent != 1 else "")
    else:
        steady, basis = _fitted(rows, fixed, exps)
    warm = model["warm_peak"]
    at_run = steady(1.0)
    if warm is not None and warm[1] > at_run:
        ratio = warm[1] / at_run
        return (lambda s: steady(s) * ratio), basis + f"; the warm-up's step {warm[0]} peak is {ratio:.2f}x it", True
    return steady, basis, False


def _fitted(rows: list, fixed: float, exps: dict) -> tuple:
    """(steady(s), basis): a step's own bytes split between its sizes by a non-negative least-squares fit through
    the origin, each size's part scaled by s to its own power (1 where the setting does not scale it: s^0), the
    worst step's residual above the fit added back, the worst step at s taken."""
    names = sorted({n for r, _ in rows for n in r})
    coef = nnls([[r.get(n, 0.0) for n in names] for r, _ in rows], [own for _, own in rows])
    fit = [sum(c * r.get(n, 0.0) for c, n in zip(coef, names)) for r, _ in rows]
    slack = max(0.0, max(own - f for (_, own), f in zip(rows, fit)))
    power = [exps.get(n, 0.0) for n in names]
    terms = [[c * r.get(n, 0.0) for c, n in zip(coef, names)] for r, _ in rows]
    steady = lambda s: fixed + slack + max(sum(t * s ** e for t, e in zip(row, power)) for row in terms)   # noqa: E731
    basis = "its own bytes split between its sizes by a least-squares fit (" + ", ".join(
        f"{n} {c:.4g} B each" + (f", as s^{exps[n]:g}" if n in exps else "") for n, c in zip(names, coef)) + ")"
    return steady, basis


def _setting(run: Run, flag: str, sizes: dict, models: list, gpus: dict, cap_flag: str | None) -> dict:
    """One setting's forecast: the largest value keeping the headroom on every GPU, at most the run's value of
    `cap_flag` where one caps it (`capped_by` then says so)."""
    key = flag.lstrip("-").replace("-", "_")
    current = run.config.get(key)
    needs = {m["rank"]: need_fn(m, flag, sizes) for m in models}
    best, limited = None, None
    for gpu, g in gpus.items():
        limit = (1.0 - HEADROOM_SHARE) * g["total_bytes"] - g["outside_bytes"]
        total = lambda s, g=g: sum(needs[r][0](s) for r in g["ranks"])   # noqa: E731
        scale = _largest_scale(total, limit)
        if best is None or scale < best[0]:
            best, limited = (scale, limit, total(1.0)), {"gpu": gpu, "ranks": sorted(g["ranks"])}
    scale, limit, at_run = best
    transient = [{"rank": m["rank"], "step": m["warm_peak"][0], "peak_bytes": m["warm_peak"][1]}
                 for m in models if needs[m["rank"]][2] and m["rank"] in limited["ranks"]]
    largest = int(current * scale) if isinstance(current, (int, float)) and scale is not None else None
    cap = run.config.get(cap_flag.lstrip("-").replace("-", "_")) if cap_flag else None
    capped = isinstance(cap, (int, float)) and largest is not None and largest >= cap
    return {"flag": flag, "current": current, "scale": scale, "largest": int(cap) if capped else largest,
            "capped_by": {"flag": cap_flag, "value": int(cap), "memory_largest": None if scale >= MAX_SCALE
                          else largest} if capped else None,
            "need_bytes_at_current": at_run, "limit_bytes": limit, "limited_by": limited, "transient": transient,
            "basis": {str(m["rank"]): needs[m["rank"]][1] for m in models}}


def _largest_scale(total, limit: float) -> float | None:
    """The largest s with total(s) <= limit (total nondecreasing), 0.0 where even s -> 0 does not fit."""
    if total(MAX_SCALE) <= limit:
        return MAX_SCALE
    lo, hi = 0.0, MAX_SCALE
    if total(lo) > limit:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= limit else (lo, mid)
    return lo


def nnls(a: list, b: list) -> list:
    """Non-negative least squares for a few columns: the best of every subset's least-squares solution whose
    coefficients are all >= 0 (2^k subsets; k, the sizes a rank names, is at most a handful)."""
    k = len(a[0]) if a else 0
    best, best_err = [0.0] * k, sum(x * x for x in b)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol = _lstsq([[row[j] for j in cols] for row in a], b)
        if sol is None or min(sol) < 0:
            continue
        coef = [0.0] * k
        for j, c in zip(cols, sol):
            coef[j] = c
        err = sum((y - sum(c * x for c, x in zip(coef, row))) ** 2 for row, y in zip(a, b))
        if err < best_err:
            best, best_err = coef, err
    return best


def _lstsq(a: list, b: list) -> list | None:
    """Least squares through the normal equations (Gaussian elimination); None where they are singular."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))] for i in range(n)]
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(m[r][i]))
        if abs(m[p][i]) < 1e-12 * max(1.0, max(abs(v) for row in m for v in row[:n])):
            return None
        m[i], m[p] = m[p], m[i]
        for r in range(n):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _public(m: dict) -> dict:
    """A rank's model as the JSON shows it (no per-step rows)."""
    return {"rank": m["rank"], "role": m["role"], "gpu": m["gpu"], "steps": m["steps"], "fixed_bytes": m["fixed_bytes"],
            "worst_step_bytes": max([m["fixed_bytes"] + own for _, own in m["rows"]], default=None),
            "warmup_peak": {"step": m["warm_peak"][0], "bytes": m["warm_peak"][1]} if m["warm_peak"] else None,
            "reserved_over_allocated_at_worst": m["reserved_ratio"]}


def largest_of(forecast: dict, config_key: str):
    """The forecast's largest value of the setting whose config key is `config_key` (`tokens_per_batch` for
    --tokens-per-batch), None where it gives none (no basis, not limited by memory, no such setting)."""
    for s in forecast.get("settings") or ():
        if s["flag"].lstrip("-").replace("-", "_") == config_key and s["scale"] is not None and s["scale"] < MAX_SCALE:
            return s["largest"]
    return None


def supersede(margin: dict, forecast: dict) -> dict:
    """The memory margin (whole-run peaks) as the report shows it beside the forecast: where the forecast gives the
    largest tokens per batch, the margin gives none (one figure for one quantity) and says so in its reason."""
    if largest_of(forecast, "tokens_per_batch") is None or margin.get("max_tokens_per_batch") is None:
        return margin
    return {**margin, "max_tokens_per_batch": None, "limited_by": None,
            "reason": "superseded by memory_forecast (each step's allocator peak, not the whole run's)"}
