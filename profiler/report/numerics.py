"""The report's Numerics section: each stage's absmax trend (the interval records' `numerics` part) up to its first
non-finite value, the numerics_drift warnings, and how many steps each came before the run's first non-finite
value (its first `nonfinite` event)."""
from __future__ import annotations

from profiler.schema import views
from profiler.report.runs import Run

TREND_SHOWN = 10   # trend points a stage's line shows (thinned evenly, its first and last kept)


def _first_nonfinite(run: Run) -> dict | None:
    """The run's first `nonfinite` event, the earliest step over every rank."""
    found = [(e.step, log.rank, e) for log in run.ranks.values() for e in map(views.event, log.events)
             if e.kind == "nonfinite" and e.step is not None]
    if not found:
        return None
    step, rank, e = min(found, key=lambda f: (f[0], f[1]))
    finding = views.Nonfinite.of(e)
    return {"step": step, "rank": rank, "span": finding.span, "tensor": finding.tensor}


def _thin(points: list, n: int) -> list:
    if len(points) <= n:
        return points
    picks = sorted({round(i * (len(points) - 1) / (n - 1)) for i in range(n)})
    return [points[i] for i in picks]


def _stages(log) -> dict:
    """{(span, tensor): the stage's figures over the rank's last segment's intervals}."""
    out: dict = {}
    for rec in map(views.interval, log.intervals):
        if rec.index == 0:
            out = {}   # a new segment: a resume's detector starts again
        for e in rec.numerics.stages.values():
            s = out.setdefault((e.span, e.tensor), {"rank": log.rank, "role": log.role, "span": e.span,
                                                     "tensor": e.tensor, "dtype": e.dtype, "samples": 0, "trend": [],
                                                     "first_nonfinite_step": None, "baseline_absmax": None,
                                                     "growth_max": None, "warning": None})
            s["samples"] += e.samples
            s["trend"] += [p for p in e.trend if isinstance(p, list) and len(p) == 2]
            s["baseline_absmax"] = e.baseline_absmax or s["baseline_absmax"]
            s["first_nonfinite_step"] = s["first_nonfinite_step"] or e.first_nonfinite_step
            if e.growth_per_step is not None:
                s["growth_max"] = max(s["growth_max"] or 0.0, e.growth_per_step)
    return out


def numerics(run: Run) -> dict:
    """{"stages": every stage of every rank (warned ones first), "warnings": the numerics_drift events' count,
    "first_nonfinite": the run's first non-finite finding or None, "samples": sampled stage-steps read}."""
    first = _first_nonfinite(run)
    stages, warnings = [], 0
    for log in run.ranks.values():
        found = _stages(log)
        for e in map(views.event, log.events):
            if e.kind == "numerics_drift":
                warnings += 1
                w = views.NumericsDrift.of(e)
                s = found.get((w.span, w.tensor))
                if s is not None and s["warning"] is None:
                    s["warning"] = {"step": w.step, "rule": w.rule, "statistic": w.statistic,
                                    "growth_per_step": w.growth_per_step, "steps_to_overflow": w.steps_to_overflow,
                                    "lead_steps": first["step"] - w.step if first and w.step is not None else None}
        stages += found.values()
    for s in stages:
        stop = s["first_nonfinite_step"]
        s["trend"] = _thin([p for p in s["trend"] if stop is None or p[0] <= stop], TREND_SHOWN)
    stages.sort(key=lambda s: (s["warning"] is None, s["first_nonfinite_step"] is None, s["rank"], s["span"],
                               s["tensor"]))
    return {"stages": stages, "warnings": warnings, "first_nonfinite": first,
            "samples": sum(s["samples"] for s in stages)}


def _g(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _trend_text(trend: list) -> str:
    return " -> ".join(f"{'non-finite' if v is None else _g(v)} @{step}" for step, v in trend)


def format_numerics(rep: dict) -> list:
    """The section's lines: the first non-finite value, each warned or non-finite stage with its trend, then a
    count of the steady ones and their largest growth."""
    n = rep.get("numerics") or {}
    if not n.get("stages"):
        return []
    first = n["first_nonfinite"]
    lines = [f"Numerics (window: whole run, {n['samples']} stage samples; absmax per stage, up to its first "
             f"non-finite value; {n['warnings']} numerics_drift warning(s))"]
    if first:
        lines.append(f"  first non-finite value: {first['tensor']} in {first['span']} at step {first['step']} "
                     f"(rank {first['rank']})")
    steady = []
    for s in n["stages"]:
        w = s["warning"]
        if w is None and s["first_nonfinite_step"] is None:
            steady.append(s)
            continue
        said = (f"warned at step {w['step']} ({w['rule']} of {w['statistic']}, x{_g(w['growth_per_step'])}/step, "
                f"~{_g(w['steps_to_overflow'])} steps to overflow)" if w else "no warning")
        if w and w["lead_steps"] is not None:
            said += f", {w['lead_steps']} steps before the first non-finite value"
        lines.append(f"  rank {s['rank']} {s['role']} {s['span']} {s['tensor']} ({s['dtype']}, {s['samples']} "
                     f"samples, baseline {_g(s['baseline_absmax'])}): {said}")
        lines.append(f"    {_trend_text(s['trend'])}")
    if steady:
        top = max(steady, key=lambda s: s["growth_max"] or 0.0)
        lines.append(f"  {len(steady)} other stage(s) steady; largest interval growth x{_g(top['growth_max'])}/step "
                     f"({top['span']} {top['tensor']}, rank {top['rank']})")
    return lines
