"""Duration statistics match numpy exactly; the whole-run aggregate stays bounded."""
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
    rs = RunStats(capacity=2000, seed=5)
    rs.add(d)
    s = rs.summary()
    assert s["count"] == 20000 and s["max_seconds"] == d.max()
    assert s["total_seconds"] == pytest.approx(d.sum())
    assert len(rs._sample) == 2000
    assert abs(s["p50_seconds"] - 0.5) < 0.05 and abs(s["p95_seconds"] - 0.95) < 0.03


def test_runstats_batched_reservoir_is_uniform_over_the_run():
    """Values 0..N-1 added in uneven batches: the kept sample is a uniform draw over the whole run
    (mean N/2 within 4 standard errors, each batch kept in proportion to its size), not biased
    towards the first or the last batch."""
    n, cap = 40000, 2000
    values = np.arange(n, dtype=np.float64)
    rs = RunStats(capacity=cap, seed=11)
    for lo, hi in ((0, 1500), (1500, 2500), (2500, 20000), (20000, 20001), (20001, n)):
        rs.add(values[lo:hi])
    kept = np.asarray(rs._sample)
    assert rs.count == n and kept.size == cap and np.unique(kept).size == cap
    assert abs(kept.mean() - (n - 1) / 2) < 4 * n / np.sqrt(12 * cap)
    for lo, hi in ((0, 2500), (2500, 20000), (20000, n)):
        share = np.count_nonzero((kept >= lo) & (kept < hi)) / cap
        assert abs(share - (hi - lo) / n) < 0.04
