"""Paired on/off statistics (standard library only): per-arm summaries, the paired t interval of the
per-pair log ratios, and the "resolves 1%" / "within 1%" verdicts. Read by `dflash-profile overhead`
(profiler/overhead.py: in-run phases) and bench/ab_profile.py (whole runs); `pooled_stats` combines several
runs' ratios (bench/pool_ab.py: one estimate from several device calls).

The mean paired difference is the geometric mean ratio minus 1, with a `level` t interval from the per-pair
log ratios; the t quantile comes from the regularized incomplete beta function (no scipy). "resolves 1%":
the interval's half-width is at most 1%. "within 1%" is one-sided, since the question is the profiler's
cost: yes when the interval's lower end is at or above -1%, no when its upper end is below -1%, otherwise
(or with fewer than 2 pairs) undetermined.
"""
from __future__ import annotations

import math
import statistics

DEFAULT_LEVEL = 0.95
THRESHOLD_PCT = 1.0


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Lentz's continued fraction of the incomplete beta function (Numerical Recipes, betacf)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for aa in (m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t value with P(T <= t) = p (0.5 < p < 1), by bisection on t_cdf to 1e-12."""
    if not 0.5 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile: need 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


def arm_stats(values: list[float]) -> dict:
    """n, mean, median, coefficient of variation (sample stdev / mean), min and max of one arm."""
    n = len(values)
    mean = statistics.fmean(values) if n else None
    cv = statistics.stdev(values) / mean if n > 1 and mean else None
    return {"n": n, "mean": mean, "median": statistics.median(values) if n else None, "cv": cv,
            "min": min(values) if n else None, "max": max(values) if n else None}


def paired_stats(on: list[float], off: list[float], level: float = DEFAULT_LEVEL) -> dict:
    """The paired comparison of on against off (same index = same pair): each pair's ratio on/off,
    the geometric mean ratio as a difference in %, and its `level` t interval from the log ratios."""
    if len(on) != len(off):
        raise ValueError(f"paired_stats: {len(on)} on values but {len(off)} off values")
    logs = [math.log(a / b) for a, b in zip(on, off)]
    n = len(logs)
    out = {"n": n, "ratios": [a / b for a, b in zip(on, off)], "level": level,
           "mean_diff_pct": 100.0 * (math.exp(statistics.fmean(logs)) - 1.0) if n else None,
           "sd_log_ratio": statistics.stdev(logs) if n > 1 else None,
           "t_quantile": None, "ci_low_pct": None, "ci_high_pct": None, "half_width_pct": None}
    if n > 1:
        t = t_quantile(0.5 + level / 2.0, n - 1)
        mean, half = statistics.fmean(logs), t * statistics.stdev(logs) / math.sqrt(n)
        low, high = 100.0 * (math.exp(mean - half) - 1.0), 100.0 * (math.exp(mean + half) - 1.0)
        out.update(t_quantile=t, ci_low_pct=low, ci_high_pct=high, half_width_pct=(high - low) / 2.0)
    return out


def verdicts(paired: dict, threshold_pct: float = THRESHOLD_PCT) -> dict:
    """"resolves": the interval is at most +-threshold wide; "within": the on arm's cost, one-sided."""
    half, low, high = paired.get("half_width_pct"), paired.get("ci_low_pct"), paired.get("ci_high_pct")
    resolves = half is not None and half <= threshold_pct
    if low is None:
        within = "undetermined"
    elif low >= -threshold_pct:
        within = "yes"
    elif high < -threshold_pct:
        within = "no"
    else:
        within = "undetermined"
    return {"threshold_pct": threshold_pct, "resolves": resolves, "within": within,
            "on_faster_beyond_threshold": low is not None and low > threshold_pct}


def pooled_stats(runs: list[list[float]], level: float = DEFAULT_LEVEL) -> dict:
    """Several paired runs' on/off ratios (one list per run) as one estimate: each run's mean log ratio
    weighted by the inverse of its variance (sd^2 / n), since runs on different machines differ in both
    level and spread; a `level` t interval on sum(n) - runs degrees of freedom. `q` is Cochran's Q (the
    weighted spread of the runs' means around the pooled one; about runs - 1 when they agree) and `i2`
    the share of that spread beyond chance, max(0, (q - df) / q). Keys as paired_stats' (no ratios)."""
    if not runs:
        raise ValueError("pooled_stats: no runs")
    means, weights, total = [], [], 0
    for ratios in runs:
        if len(ratios) < 2:
            raise ValueError(f"pooled_stats: every run needs 2 pairs or more, got {len(ratios)}")
        logs = [math.log(r) for r in ratios]
        sd = statistics.stdev(logs)
        if sd == 0:
            raise ValueError("pooled_stats: a run whose pairs all have the same ratio has no spread to weigh")
        means.append(statistics.fmean(logs))
        weights.append(len(logs) / sd ** 2)
        total += len(logs)
    mean = sum(w * m for w, m in zip(weights, means)) / sum(weights)
    t = t_quantile(0.5 + level / 2.0, total - len(runs))
    half = t / math.sqrt(sum(weights))
    low, high = 100.0 * (math.exp(mean - half) - 1.0), 100.0 * (math.exp(mean + half) - 1.0)
    q = sum(w * (m - mean) ** 2 for w, m in zip(weights, means))
    return {"n": total, "runs": len(runs), "level": level, "mean_diff_pct": 100.0 * (math.exp(mean) - 1.0),
            "t_quantile": t, "ci_low_pct": low, "ci_high_pct": high, "half_width_pct": (high - low) / 2.0,
            "q": q, "i2": max(0.0, (q - (len(runs) - 1)) / q) if q > 0 else 0.0}
