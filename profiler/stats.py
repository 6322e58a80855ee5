"""Duration statistics: count/total/mean/p50/p95/p99/max, plus a bounded whole-run aggregate."""
from __future__ import annotations

import random

import numpy as np

STAT_KEYS = ("total_seconds", "mean_seconds", "p50_seconds", "p95_seconds", "p99_seconds", "max_seconds")
# Upper bounds of the span-time histogram (Prometheus `le`); one more, implicit bucket is +Inf. Fixed,
# so bucket counts add up across intervals and ranks (histogram_quantile over sum by (le)).
HISTOGRAM_BUCKETS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                             0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_BOUNDS = np.asarray(HISTOGRAM_BUCKETS_SECONDS)


def summarize(durations_seconds, buckets: bool = False) -> dict:
    """{"count", "total_seconds", "mean_seconds", "p50_seconds", "p95_seconds", "p99_seconds",
    "max_seconds"} of a sequence of durations; percentiles are numpy's (linear interpolation).
    With `buckets`, also "buckets": counts per HISTOGRAM_BUCKETS_SECONDS bound (value <= bound,
    Prometheus' `le`) plus one for +Inf, not cumulative. An empty input gives count 0 and None for
    the rest (nothing measured is not zero)."""
    a = np.asarray(durations_seconds, dtype=np.float64)
    if a.size == 0:
        out = {"count": 0, **{k: None for k in STAT_KEYS}}
        if buckets:
            out["buckets"] = [0] * (len(HISTOGRAM_BUCKETS_SECONDS) + 1)
        return out
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    total = float(a.sum())
    out = {"count": int(a.size), "total_seconds": total, "mean_seconds": total / a.size,
           "p50_seconds": float(p50), "p95_seconds": float(p95), "p99_seconds": float(p99),
           "max_seconds": float(a.max())}
    if buckets:
        idx = np.searchsorted(_BOUNDS, a, side="left")   # first bound >= value
        out["buckets"] = np.bincount(idx, minlength=len(_BOUNDS) + 1).tolist()
    return out


class RunStats:
    """Whole-run aggregate of one duration series in bounded memory: count, total and max are
    exact; percentiles come from a uniform reservoir sample of `capacity` values (exact while the
    run has at most `capacity` values)."""

    def __init__(self, capacity: int = 65536, rng: random.Random | None = None):
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.max = None
        self._sample: list = []
        self._rng = rng or random.Random(0)

    def add(self, durations_seconds) -> None:
        for d in durations_seconds:
            d = float(d)
            self.count += 1
            self.total += d
            if self.max is None or d > self.max:
                self.max = d
            if len(self._sample) < self.capacity:
                self._sample.append(d)
            else:   # Algorithm R: keep each of the `count` values with probability capacity/count
                j = self._rng.randrange(self.count)
                if j < self.capacity:
                    self._sample[j] = d

    def summary(self) -> dict:
        if self.count == 0:
            return {"count": 0, **{k: None for k in STAT_KEYS}}
        p50, p95, p99 = np.percentile(np.asarray(self._sample), [50, 95, 99])
        return {"count": self.count, "total_seconds": self.total, "mean_seconds": self.total / self.count,
                "p50_seconds": float(p50), "p95_seconds": float(p95), "p99_seconds": float(p99),
                "max_seconds": self.max}
