"""Duration statistics: count/total/mean/p50/p95/p99/max, plus a bounded whole-run aggregate."""
from __future__ import annotations

import random

import numpy as np

STAT_KEYS = ("total_seconds", "mean_seconds", "p50_seconds", "p95_seconds", "p99_seconds", "max_seconds")


def summarize(durations_seconds) -> dict:
    """{"count", "total_seconds", "mean_seconds", "p50_seconds", "p95_seconds", "p99_seconds",
    "max_seconds"} of a sequence of durations; percentiles are numpy's (linear interpolation).
    An empty input gives count 0 and None for the rest (nothing measured is not zero)."""
    a = np.asarray(durations_seconds, dtype=np.float64)
    if a.size == 0:
        return {"count": 0, **{k: None for k in STAT_KEYS}}
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    total = float(a.sum())
    return {"count": int(a.size), "total_seconds": total, "mean_seconds": total / a.size,
            "p50_seconds": float(p50), "p95_seconds": float(p95), "p99_seconds": float(p99),
            "max_seconds": float(a.max())}


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
