"""Duration statistics: count/total/mean/p50/p95/p99/max, plus a bounded whole-run aggregate."""
from __future__ import annotations

import numpy as np

STAT_KEYS = ("total_seconds", "mean_seconds", "p50_seconds", "p95_seconds", "p99_seconds", "max_seconds")
# Upper bounds of the span-time histogram (Prometheus `le`); one more, implicit bucket is +Inf. Fixed,
# so bucket counts add up across intervals and ranks (histogram_quantile over sum by (le)).
HISTOGRAM_BUCKETS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                             0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_BOUNDS = np.asarray(HISTOGRAM_BUCKETS_SECONDS)


def as_seconds(durations_seconds) -> np.ndarray:
    """A flat float64 array of durations (what summarize and RunStats.add read; an array passes as is)."""
    return np.asarray(durations_seconds, dtype=np.float64).ravel()


def summarize(durations_seconds, buckets: bool = False) -> dict:
    """{"count", *STAT_KEYS} of a sequence of durations (empty: count 0 and None, nothing measured is not zero);
    with `buckets`, also the counts per HISTOGRAM_BUCKETS_SECONDS bound (value <= bound, Prometheus' `le`)
    plus one for +Inf, not cumulative."""
    a = as_seconds(durations_seconds)
    out = _summary(int(a.size), float(a.sum()), float(a.max()) if a.size else None, a)
    if buckets:
        idx = np.searchsorted(_BOUNDS, a, side="left")   # first bound >= value
        out["buckets"] = np.bincount(idx, minlength=len(_BOUNDS) + 1).tolist()
    return out


def _summary(count: int, total_s: float, max_s, sample: np.ndarray) -> dict:
    """The summary of `count` durations whose percentiles `sample` gives (numpy's linear interpolation)."""
    if count == 0:
        return {"count": 0, **dict.fromkeys(STAT_KEYS)}
    p50, p95, p99 = np.percentile(sample, [50, 95, 99]).tolist()
    return {"count": count, "total_seconds": total_s, "mean_seconds": total_s / count,
            "p50_seconds": p50, "p95_seconds": p95, "p99_seconds": p99, "max_seconds": max_s}


class RunStats:
    """Whole-run aggregate of one duration series in bounded memory: count, total and max exact, percentiles
    from a uniform reservoir sample of `capacity` values."""

    def __init__(self, capacity: int = 65536, seed: int = 0):
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.max = None
        self._sample = np.empty(0)
        self._rng = np.random.default_rng(seed)

    def add(self, durations_seconds) -> None:
        """Fold a batch in (one interval's durations of one span name), vectorized. Algorithm R over the
        batch: value number k (1-based over the run) is kept with probability capacity/k, at a uniform slot;
        among several batch values drawn to the same slot, the last one stays, as in the sequential loop."""
        a = as_seconds(durations_seconds)
        if a.size == 0:
            return
        first = self.count
        self.count += int(a.size)
        self.total += float(a.sum())
        top = float(a.max())
        self.max = top if self.max is None or top > self.max else self.max
        room = max(0, self.capacity - self._sample.size)
        if room:   # still filling
            self._sample = np.concatenate([self._sample, a[:room]])
        rest = a[room:]
        if rest.size:
            ks = np.arange(first + room + 1, first + a.size + 1)   # each value's 1-based index in the run
            slots = np.floor(self._rng.random(rest.size) * ks).astype(np.int64)
            kept_slots, kept = slots[slots < self.capacity], rest[slots < self.capacity]
            _, from_end = np.unique(kept_slots[::-1], return_index=True)   # the last value per slot
            last = kept_slots.size - 1 - from_end
            self._sample[kept_slots[last]] = kept[last]

    def summary(self) -> dict:
        return _summary(self.count, self.total, self.max, self._sample)
