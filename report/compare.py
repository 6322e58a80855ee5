"""A/B comparison of two runs (A the baseline): spans, tokens/s and GPU memory, each sampled once per interval
of every rank's steady window (runs.steady_window; spread: the 10th-90th percentile range). A change is a
regression (or improvement) only beyond the larger spread, negligible under MIN_EFFECT_SHARE of its role's
time; wait spans show as waits.
"""
from __future__ import annotations

import statistics
from collections import Counter

from monitoring.catalog import WAIT_SPANS
from profiler.windows import basis, whole_seconds
from report.runs import Run, gpu_key, gpus, merged_window, steady_window, wall_seconds

MIN_SAMPLES = 2
MIN_EFFECT_SHARE = 0.01


def _summary(values: list) -> dict:
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [0.0] * 9
    return {"mean": statistics.fmean(values) if values else None, "intervals": len(values),
            "spread": deciles[-1] - deciles[0] if values else None}


def classify(a: list, b: list, higher_is_worse: bool = True, min_delta: float = 0.0) -> dict:
    """{"a", "b" (mean, intervals, spread), "change_ratio", "verdict"} for two runs' per-interval samples;
    a change beyond the spread but under min_delta is "negligible"."""
    sa, sb = _summary(a), _summary(b)
    out = {"a": sa, "b": sb, "change_ratio": None, "verdict": "within spread"}
    if not a or not b:
        out["verdict"] = "only in B" if b else "only in A"
        return out
    if sa["mean"]:
        out["change_ratio"] = sb["mean"] / sa["mean"] - 1.0
    if sa["intervals"] < MIN_SAMPLES or sb["intervals"] < MIN_SAMPLES:
        out["verdict"] = "too few intervals"
        return out
    delta = sb["mean"] - sa["mean"]
    if abs(delta) > max(sa["spread"], sb["spread"]):
        out["verdict"] = ("negligible" if abs(delta) < min_delta
                          else "regression" if (delta > 0) == higher_is_worse else "improvement")
    return out


def _span_samples(run: Run) -> tuple[dict, dict]:
    """({(role, span): per-interval mean seconds per call}, {(role, span): calls per second of role time})."""
    out, calls, walls = {}, Counter(), Counter()
    for log in run.ranks.values():
        steady = steady_window(log).intervals
        walls[log.role] += wall_seconds(steady)
        for rec in steady:
            for name, e in (rec.get("spans") or {}).items():
                if e.get("count") and basis(e)[0].get("total_seconds") is not None:   # whole spans (a CPU total is split)
                    out.setdefault((log.role, name), []).append(whole_seconds(e) / e["count"])
                    calls[(log.role, name)] += e["count"]
    return out, {k: n / walls[k[0]] for k, n in calls.items() if walls.get(k[0])}


def _rate_samples(run: Run) -> dict:
    """{role: per-interval tokens/s of the role}: a rank's per-interval rate times the role's rank count."""
    out: dict = {}
    for role, logs in run.by_role().items():
        for log in logs:
            for rec in steady_window(log).intervals:
                rate = ((rec.get("counters") or {}).get("tokens") or {}).get("per_second")
                if rate is not None:
                    out.setdefault(role, []).append(rate * len(logs))
    return out


def _memory_samples(run: Run) -> dict:
    out: dict = {}
    for log in run.ranks.values():
        for rec in steady_window(log).intervals:
            for g in gpus(rec):
                if g.get("used_bytes_peak") is not None:
                    out.setdefault(gpu_key(log, g), []).append(g["used_bytes_peak"])
    return out


def compare(run_a: Run, run_b: Run) -> dict:
    """{"spans": rows by |change|, "tokens_per_s": per role, "memory": per GPU peak used, "regressions":
    the span names called regressions, "memory_reason" when neither run measured GPU memory, "windows": what
    each run was sampled over}."""
    (sa, ca), (sb, cb) = _span_samples(run_a), _span_samples(run_b)
    spans = []
    for key in sorted(set(sa) | set(sb)):
        calls_per_s = max(ca.get(key, 0.0), cb.get(key, 0.0))
        min_delta = MIN_EFFECT_SHARE / calls_per_s if calls_per_s else 0.0
        role, name = key
        row = {"role": role, "span": name, **classify(sa.get(key, []), sb.get(key, []), min_delta=min_delta)}
        if WAIT_SPANS.get(name) == role and row["verdict"] in ("regression", "improvement"):
            row["verdict"] = "wait " + ("longer" if row["verdict"] == "regression" else "shorter")
        spans.append(row)
    spans.sort(key=lambda r: -abs(r["change_ratio"] or 0.0))
    ra, rb = _rate_samples(run_a), _rate_samples(run_b)
    rates = {role: classify(ra.get(role, []), rb.get(role, []), higher_is_worse=False)
             for role in sorted(set(ra) | set(rb))}
    ma, mb = _memory_samples(run_a), _memory_samples(run_b)
    memory = {gpu: classify(ma.get(gpu, []), mb.get(gpu, [])) for gpu in sorted(set(ma) | set(mb))}
    return {"a": run_a.run_dir, "b": run_b.run_dir,
            "windows": {"a": merged_window(run_a.ranks.values()).label, "b": merged_window(run_b.ranks.values()).label},
            "spans": spans, "tokens_per_s": rates, "memory": memory,
            "memory_reason": None if memory else "no GPU memory measured in either run",
            "regressions": [f"{r['role']}/{r['span']}" for r in spans if r["verdict"] == "regression"]}
