"""Duration statistics match numpy exactly; the whole-run aggregate stays bounded."""
import random

import numpy as np
import pytest

from profiler.stats import RunStats, summarize


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_summarize_matches_numpy(n):
    rng = np.random.default_rng(n)
    d = rng.lognormal(-6, 1.5, size=n)
    s = summarize(list(d))
    assert s["count"] == n
    assert s["total_seconds"] == pytest.approx(d.sum(), rel=1e-12)
    assert s["mean_seconds"] == pytest.approx(d.mean(), rel=1e-12)
    for q in (50, 95, 99):
        assert s[f"p{q}_seconds"] == np.percentile(d, q)   # linear interpolation, exact
    assert s["max_seconds"] == d.max()


def test_summarize_empty_reports_nothing_measured():
    s = summarize([])
    assert s["count"] == 0 and all(v is None for k, v in s.items() if k != "count")


def test_runstats_exact_below_capacity():
    rng = np.random.default_rng(1)
    d = rng.random(500)
    rs = RunStats(capacity=1000)
    rs.add(d[:200])
    rs.add(d[200:])
    assert rs.summary() == pytest.approx(summarize(d))


def test_runstats_reservoir_beyond_capacity_keeps_exact_totals():
    rng = np.random.default_rng(2)
    d = rng.random(20000)
    rs = RunStats(capacity=2000, rng=random.Random(5))
    rs.add(d)
    s = rs.summary()
    assert s["count"] == 20000 and s["max_seconds"] == d.max()
    assert s["total_seconds"] == pytest.approx(d.sum())
    assert len(rs._sample) == 2000
    assert abs(s["p50_seconds"] - 0.5) < 0.05 and abs(s["p95_seconds"] - 0.95) < 0.03
