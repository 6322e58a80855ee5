"""A/B comparison of two runs (A the baseline): spans and tokens/s sampled once per window of every rank, both
runs over the same kind of window per role (windows_alike: steady tick windows where both runs wrote ticks, else
steady intervals; all of them where one run has none steady), GPU memory once per steady interval (spread: the
10th-90th percentile range; a span's mean is per call, its windows weighted by their calls). A change is a
regression (or improvement) only beyond the larger of the two runs' spread of the mean (spread / sqrt(n): the
range a mean of n such samples varies over), negligible under MIN_EFFECT_SHARE of its role's time; wait spans
show as waits.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from profiler.schema.windows import counter_per_second, entry_count, gpu_peak_bytes, per_call_seconds, span_entries
from profiler.report.runs import Run, gpu_key, gpus, merged_window, span_kinds, steady_window, wall_seconds

MIN_SAMPLES = 2
MIN_EFFECT_SHARE = 0.01
TOO_FEW = "too few windows"


def _summary(values: list, weights: list | None = None) -> dict:
    """{"mean" (weighted by `weights` when given), "intervals" (the sample count), "spread" (the samples' 10th-90th
    percentile range), "mean_spread" (the range their mean varies over: spread / sqrt(n))}."""
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [0.0] * 9
    spread = deciles[-1] - deciles[0] if values else None
    mean = statistics.fmean(values, weights) if values else None
    return {"mean": mean, "intervals": len(values), "spread": spread,
            "mean_spread": spread / math.sqrt(len(values)) if values else None}


def classify(a: list, b: list, higher_is_worse: bool = True, min_delta: float = 0.0,
             weights: tuple = (None, None)) -> dict:
    """{"a", "b" (_summary), "change_ratio", "verdict"} for two runs' per-window samples (their means weighted by
    `weights`, one list per run, when given): a change is called when the means differ by more than the larger
    of the two runs' mean_spread; beyond it but under min_delta it is "negligible"."""
    sa, sb = _summary(a, weights[0]), _summary(b, weights[1])
    out = {"a": sa, "b": sb, "change_ratio": None, "verdict": "within spread"}
    if not a or not b:
        out["verdict"] = "only in B" if b else "only in A"
        return out
    if sa["mean"]:
        out["change_ratio"] = sb["mean"] / sa["mean"] - 1.0
    if sa["intervals"] < MIN_SAMPLES or sb["intervals"] < MIN_SAMPLES:
        out["verdict"] = TOO_FEW
        return out
    delta = sb["mean"] - sa["mean"]
    if abs(delta) > max(sa["mean_spread"], sb["mean_spread"]):
        out["verdict"] = ("negligible" if abs(delta) < min_delta
                          else "regression" if (delta > 0) == higher_is_worse else "improvement")
    return out


def windows_alike(run_a: Run, run_b: Run) -> dict:
    """{role: (ticks, steady)}: the kind of window both runs are read over, per role: tick windows when every
    rank of the role in both runs has them, else intervals; steady ones when both runs have some, else all."""
    out = {}
    roles_a, roles_b = run_a.by_role(), run_b.by_role()
    for role in sorted(set(roles_a) | set(roles_b)):
        logs = roles_a.get(role, []) + roles_b.get(role, [])
        ticks = all(log.tick_windows for log in logs)
        steady = all(not merged_window(side, ticks).fallback for side in (roles_a.get(role), roles_b.get(role))
                     if side)
        out[role] = (ticks, steady)
    return out


def _role_windows(logs: list, ticks: bool, steady: bool) -> tuple[dict, object]:
    """({rank: its windows}, their merged Window): the ranks' steady windows, or all of them when not `steady`."""
    if steady:
        return {log.rank: steady_window(log, ticks).intervals for log in logs}, merged_window(logs, ticks)
    mine = {log.rank: list(log.tick_windows if ticks else log.intervals) for log in logs}
    everything = [r for rank in sorted(mine) for r in mine[rank]]
    w = merged_window(logs, ticks)
    kind = "tick windows" if ticks else "intervals"
    if w.fallback and not w.steady and w.phased:   # its own window is past warm-up only: read all, as the other
        return mine, AllWindows(everything, f"all {len(everything)} {kind} (none steady: warm-up, phases or final)")
    if w.fallback and not w.steady:   # none steady here either: its own label says so
        return mine, w
    return mine, AllWindows(everything, f"all {len(everything)} {kind} (read alike: the other run has no steady "
                                        f"{kind})")


@dataclass(frozen=True)
class AllWindows:
    """All of a role's windows, read so because the other run of a compare has no steady one."""
    intervals: list
    label: str


def _samples(run: Run, kinds: dict, memory_steady: bool) -> dict:
    """One sample per window of each rank (the role's kind of window, `kinds`: windows_alike): {"spans": {(role,
    span): mean seconds per call}, "calls_per_s": {(role, span): calls per second of role time}, "rates": {role:
    tokens/s, a rank's rate times the role's rank count}, "memory": {gpu: NVML peak used, per steady interval, or
    per interval where one run has none `memory_steady`},
    "windows": {role: their name}, "present": every (role, span) the run has in any interval}."""
    out = {"spans": defaultdict(list), "calls": defaultdict(list), "rates": {}, "memory": {}, "windows": {},
           "present": set()}
    walls = Counter()
    spans, counts = out["spans"], out["calls"]   # a million entries in a week-long log: no lookup per entry
    for role, logs in run.by_role().items():
        per_rank, w = _role_windows(logs, *kinds[role])
        out["windows"][role] = w.label
        for log in logs:
            walls[role] += wall_seconds(per_rank[log.rank])
            names: set = set()
            for rec in log.intervals:
                names.update(span_entries(rec))
            out["present"] |= {(role, n) for n in names}
            _sample_spans(per_rank[log.rank], role, spans, counts)
            for rec in per_rank[log.rank]:
                rate = counter_per_second(rec, "tokens")
                if rate is not None:
                    out["rates"].setdefault(role, []).append(rate * len(logs))
            memory = steady_window(log, ticks=False).intervals if memory_steady else log.intervals
            for rec in memory:   # NVML: interval records only
                for g in gpus(rec):
                    if (peak := gpu_peak_bytes(g)[0]) is not None:
                        out["memory"].setdefault(gpu_key(log, g), []).append(peak)
    out["spans"], out["calls"] = dict(spans), dict(counts)
    out["calls_per_s"] = {k: sum(n) / walls[k[0]] for k, n in counts.items() if walls.get(k[0])}
    out["window"] = "; ".join(f"{role}: {label}" for role, label in out["windows"].items())
    w = merged_window(run.ranks.values(), ticks=False)
    out["memory_window"] = w.label if memory_steady or not w.steady else \
        f"all {sum(len(log.intervals) for log in run.ranks.values())} intervals (read alike: the other run has no " \
        "steady intervals)"
    return out


def _sample_spans(windows: list, role: str, spans: defaultdict, counts: defaultdict) -> None:
    """Each window's mean seconds per call (windows.per_call_seconds) and call count of every span it timed,
    appended to spans[role, name] and counts[role, name]."""
    for rec in windows:
        for name, e in span_entries(rec).items():
            seconds = per_call_seconds(e)
            if seconds is not None:
                spans[role, name].append(seconds)
                counts[role, name].append(entry_count(e))


def _span_rows(a: dict, b: dict, waits: set) -> list:
    """A row per (role, span) either run sampled, by |change|; a span both runs have but one did not sample in
    the window (a phase span outside the steady windows) is "too few windows", never "only in" one run; `waits`:
    the (role, span) pairs in which a role waits on the other side in either run."""
    spans = []
    for key in sorted(set(a["spans"]) | set(b["spans"])):
        calls_per_s = max(a["calls_per_s"].get(key, 0.0), b["calls_per_s"].get(key, 0.0))
        min_delta = MIN_EFFECT_SHARE / calls_per_s if calls_per_s else 0.0
        role, name = key
        row = {"role": role, "span": name, **classify(a["spans"].get(key, []), b["spans"].get(key, []),
                                                      min_delta=min_delta,
                                                      weights=(a["calls"].get(key), b["calls"].get(key)))}
        if row["verdict"].startswith("only in") and key in a["present"] and key in b["present"]:
            row["verdict"] = TOO_FEW
        if key in waits and row["verdict"] in ("regression", "improvement"):
            row["verdict"] = "wait " + ("longer" if row["verdict"] == "regression" else "shorter")
        spans.append(row)
    spans.sort(key=lambda r: -abs(r["change_ratio"] or 0.0))
    return spans


def compare(run_a: Run, run_b: Run) -> dict:
    """{"spans": rows by |change|, "tokens_per_s": per role, "memory": per GPU peak used, "regressions": every
    row called a regression (spans as role/span, rates as "tokens/s (role)", memory as "peak used (gpu)"),
    "memory_reason" when neither run measured GPU memory, "windows": what each run was sampled over (per role in
    "role_windows": both runs over the same kind, windows_alike)}."""
    kinds = windows_alike(run_a, run_b)
    memory_steady = all(merged_window(r.ranks.values(), ticks=False).steady for r in (run_a, run_b))
    a = _samples(run_a, kinds, memory_steady)
    b = a if run_b is run_a else _samples(run_b, kinds, memory_steady)   # a run against itself: sampled once
    waits = {(role, name) for run in (run_a, run_b) for name, role in span_kinds(run).waits().items()}
    spans = _span_rows(a, b, waits)
    rates = {role: classify(a["rates"].get(role, []), b["rates"].get(role, []), higher_is_worse=False)
             for role in sorted(set(a["rates"]) | set(b["rates"]))}
    memory = {gpu: classify(a["memory"].get(gpu, []), b["memory"].get(gpu, []))
              for gpu in sorted(set(a["memory"]) | set(b["memory"]))}
    regressions = ([f"{r['role']}/{r['span']}" for r in spans if r["verdict"] == "regression"]
                   + [f"tokens/s ({role})" for role, c in rates.items() if c["verdict"] == "regression"]
                   + [f"peak used (gpu {gpu})" for gpu, c in memory.items() if c["verdict"] == "regression"])
    return {"a": run_a.run_dir, "b": run_b.run_dir, "windows": {"a": a["window"], "b": b["window"]},
            "role_windows": {role: {"a": a["windows"].get(role), "b": b["windows"].get(role)} for role in kinds},
            "memory_windows": {"a": a["memory_window"], "b": b["memory_window"]},
            "spans": spans, "tokens_per_s": rates, "memory": memory,
            "memory_reason": None if memory else "no GPU memory measured in either run", "regressions": regressions}
