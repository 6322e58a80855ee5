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


def samples(run: Run) -> dict:
    """One sample per interval of each rank's steady window: {"spans": {(role, span): mean seconds per call},
    "calls_per_s": {(role, span): calls per second of role time}, "rates": {role: tokens/s, a rank's rate times
    the role's rank count}, "memory": {gpu: NVML peak used}, "window": their name, "run_dir"}."""
    out = {"spans": {}, "rates": {}, "memory": {}}
    calls, walls = Counter(), Counter()
    roles = run.by_role()
    for log in run.ranks.values():
        steady = steady_window(log).intervals
        walls[log.role] += wall_seconds(steady)
        for rec in steady:
            for name, e in (rec.get("spans") or {}).items():
                # whole spans: a CPU total is split at the interval's edges
                if e.get("count") and basis(e)[0].get("total_seconds") is not None:
                    out["spans"].setdefault((log.role, name), []).append(whole_seconds(e) / e["count"])
                    calls[(log.role, name)] += e["count"]
            rate = ((rec.get("counters") or {}).get("tokens") or {}).get("per_second")
            if rate is not None:
                out["rates"].setdefault(log.role, []).append(rate * len(roles[log.role]))
            for g in gpus(rec):
                if g.get("used_bytes_peak") is not None:
                    out["memory"].setdefault(gpu_key(log, g), []).append(g["used_bytes_peak"])
    out["calls_per_s"] = {k: n / walls[k[0]] for k, n in calls.items() if walls.get(k[0])}
    out["window"] = merged_window(run.ranks.values()).label
    out["run_dir"] = run.run_dir
    return out


def compare(run_a: Run, run_b: Run) -> dict:
    """{"spans": rows by |change|, "tokens_per_s": per role, "memory": per GPU peak used, "regressions":
    the span names called regressions, "memory_reason" when neither run measured GPU memory, "windows": what
    each run was sampled over}."""
    return compare_samples(samples(run_a), samples(run_b))


def compare_samples(a: dict, b: dict) -> dict:
    """compare() from the two runs' samples (report.compare takes each run's and lets the run go before loading
    the next: a compare holds one run's records at a time)."""
    spans = []
    for key in sorted(set(a["spans"]) | set(b["spans"])):
        calls_per_s = max(a["calls_per_s"].get(key, 0.0), b["calls_per_s"].get(key, 0.0))
        min_delta = MIN_EFFECT_SHARE / calls_per_s if calls_per_s else 0.0
        role, name = key
        row = {"role": role, "span": name, **classify(a["spans"].get(key, []), b["spans"].get(key, []),
                                                      min_delta=min_delta)}
        if WAIT_SPANS.get(name) == role and row["verdict"] in ("regression", "improvement"):
            row["verdict"] = "wait " + ("longer" if row["verdict"] == "regression" else "shorter")
        spans.append(row)
    spans.sort(key=lambda r: -abs(r["change_ratio"] or 0.0))
    rates = {role: classify(a["rates"].get(role, []), b["rates"].get(role, []), higher_is_worse=False)
             for role in sorted(set(a["rates"]) | set(b["rates"]))}
    memory = {gpu: classify(a["memory"].get(gpu, []), b["memory"].get(gpu, []))
              for gpu in sorted(set(a["memory"]) | set(b["memory"]))}
    return {"a": a["run_dir"], "b": b["run_dir"], "windows": {"a": a["window"], "b": b["window"]},
            "spans": spans, "tokens_per_s": rates, "memory": memory,
            "memory_reason": None if memory else "no GPU memory measured in either run",
            "regressions": [f"{r['role']}/{r['span']}" for r in spans if r["verdict"] == "regression"]}
