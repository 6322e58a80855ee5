"""dflash-report check (profiler/report/check.py): run logs written as docs/RUNLOG.md says, a clean one (a compile
outlier among GPU-timed steps, nested spans, a span crossing an interval boundary, a resumed run) that keeps
every invariant, then one broken invariant at a time, which the check names with its place; the CLI's exit
codes; the plot's stacks of self time; and the suite's shared real run."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import profiler.report.check as check_mod
from dflash import report_cli
from profiler.schema.span_kinds import FALLBACK, PHASE
from profiler.report.check import check, check_run
from profiler.report.plot import timeline
from profiler.report.runs import load_run

T0 = 1_000_000.0           # Unix seconds the crafted run starts at
PHASES = FALLBACK.names(PHASE)   # the crafted logs' run_starts hold no span_table: dflash-train's phases then
D, T = "drafter.main", "target.main"


def stats(values: list, total: float | None = None, own: float | None = None) -> dict:
    """A cpu/gpu block of whole span `values`, its split `total` and self time `own` (default: their sum)."""
    v = sorted(values)
    total = sum(v) if total is None else total

    def q(p):
        return v[min(len(v) - 1, int(p * len(v)))] if v else None

    return {"total_seconds": total, "self_seconds": total if own is None else own,
            "mean_seconds": sum(v) / len(v) if v else None, "p50_seconds": q(0.5), "p95_seconds": q(0.95),
            "p99_seconds": q(0.99), "max_seconds": v[-1] if v else None}


def entry(values: list, thread: str, total=None, own=None, gpu: list | None = None, open_s: float = 0.0) -> dict:
    """A span entry of a 1 s interval; GPU-timed when `gpu` (its share capped at the interval)."""
    e = {"count": len(values), "threads": [thread], "cpu": stats(values, total, own), "open_cpu_seconds": open_s}
    e["share"] = e["cpu"]["total_seconds"]
    if gpu is not None:
        e["gpu"], e["gpu_count"] = stats(gpu), len(gpu)
        e["share"] = min(1.0, sum(gpu))
    return e


def interval(rank: int, role: str, index: int, step: int, spans: dict, tokens: int, t0: float, **marks) -> dict:
    return {"type": "interval", "rank": rank, "role": role, "index": index, "step": step,
            "time_unix": t0 + index + 1.0, "duration_seconds": 1.0, "spans": spans,
            "counters": {"tokens": {"total": tokens, "per_second": float(tokens)}}, **marks}


def drafter_intervals(t0: float = T0, warm: bool = True) -> list:
    """Interval 0: the first step, compiling (a 0.7 s GPU outlier; drafter.compile nested in drafter.fwd_bwd:
    0.85 s total, 0.25 s self); drafter.recv open across the 1->2 boundary (0.3 s, then 0.2 s, 0.5 s whole)."""
    return [
        interval(0, "drafter", 0, 1, {"drafter.recv": entry([0.1], D),
                                      "drafter.fwd_bwd": entry([0.85], D, own=0.25, gpu=[0.7]),
                                      "drafter.compile": entry([0.6], D)}, 100, t0, **({"warmup": True} if warm else {})),
        interval(0, "drafter", 1, 5, {"drafter.fwd_bwd": entry([0.15] * 4, D, gpu=[0.05, 0.05, 0.06, 0.05]),
                                      "drafter.optim": entry([0.02] * 4, D),
                                      "drafter.recv": entry([], D, total=0.3, open_s=0.3)}, 400, t0,
                 **({"warmup": True} if warm else {})),
        interval(0, "drafter", 2, 8, {"drafter.recv": entry([0.5], D, total=0.2),
                                      "drafter.fwd_bwd": {**entry([0.2] * 3, D, gpu=[0.05] * 3), "gpu_lag": _lag(3, 3)},
                                      "ckpt.save": entry([0.1], D)}, 300, t0, final=True),
    ]


def target_intervals(t0: float = T0) -> list:
    return [interval(1, "target", k, 3 * k + 3, {"target.fwd": entry([0.15] * 3, T),
                                                  "transfer.send": entry([0.05] * 3, T)}, 300, t0,
                     **({"warmup": True} if k == 0 else {}), **({"final": True} if k == 2 else {}))
            for k in range(3)]


def run_end(rank: int, role: str, intervals: list, step: int) -> dict:
    """The segment's aggregates, as profiler/intervals.py sums them: counts, split CPU totals and self times;
    the whole segment's percentiles where a span's spans all ended in one interval (then they are its)."""
    spans: dict = {}
    for rec in intervals:
        for name, e in rec["spans"].items():
            s = spans.setdefault(name, {"count": 0, "threads": e["threads"], "intervals": 0, "cpu": {
                "total_seconds": 0.0, "self_seconds": 0.0, "max_seconds": None}})
            s["count"] += e["count"]
            s["intervals"] += 1
            s["cpu"]["total_seconds"] += e["cpu"]["total_seconds"]
            s["cpu"]["self_seconds"] += e["cpu"]["self_seconds"]
            if e["cpu"]["max_seconds"] is not None:
                s["cpu"]["max_seconds"] = max(s["cpu"]["max_seconds"] or 0.0, e["cpu"]["max_seconds"])
                s["cpu"].update({k: e["cpu"][k] for k in ("p50_seconds", "p95_seconds")})
    for s in spans.values():
        if s.pop("intervals") > 1:
            s["cpu"].pop("p50_seconds", None), s["cpu"].pop("p95_seconds", None)
    tokens = sum(r["counters"]["tokens"]["total"] for r in intervals)
    return {"type": "run_end", "rank": rank, "role": role, "step": step, "status": "ok",
            "time_unix": intervals[-1]["time_unix"] + 0.01, "duration_seconds": float(len(intervals)),
            "intervals": len(intervals), "spans": spans, "counters": {"tokens": {"total": tokens}}}


def throughput(rank: int, role: str, rate: float, at: float, steps: int = 6) -> dict:
    return {"type": "event", "kind": "throughput", "rank": rank, "role": role, "time_unix": at,
            "window": "steady state", "steady_tokens_per_s": rate, "steady_tokens": rate * 2.0,
            "steady_seconds": 2.0, "steady_steps": steps, "phases_seconds": {"ckpt.save": 0.1}}


def segment(rank: int, role: str, intervals: list, step: int, rate: float) -> list:
    start = {"type": "run_start", "rank": rank, "role": role, "schema": 1, "run_id": "run", "hostname": "h",
             "time_unix": intervals[0]["time_unix"] - 1.0, "interval_s": 1.0, "warmup_steps": 2,
             "phase_spans": list(PHASES)}
    return [start, *intervals, throughput(rank, role, rate, intervals[-1]["time_unix"] - 0.05),
            run_end(rank, role, intervals, step)]


def flows(rank: int, name: str, thread: str, batches: range, t0: float) -> dict:
    """A detail window: one `name` span per batch, tagged with its flow (target rank 1's batch b)."""
    ns = int(t0 * 1e9)
    return {"type": "spans", "rank": rank, "index": 1, "steps": [1, 3], "dropped": 0, "spans": [
        {"id": b, "parent": None, "name": name, "thread": thread, "tid": 100 + rank, "depth": 0,
         "start_unix_ns": ns + b * 10_000_000, "end_unix_ns": ns + b * 10_000_000 + 5_000_000,
         "cpu_seconds": 0.005, "gpu_seconds": None, "bytes": None, "attrs": {"flow": f"1:{b}"}} for b in batches]}


def clean(resumed: bool = False) -> dict:
    """{"logs": {rank: [records]}, "files": {rank: throughput file}}: a run that keeps every invariant."""
    drafter = segment(0, "drafter", drafter_intervals(), 7, 350.0)
    drafter.insert(4, flows(0, "drafter.recv", D, range(1, 5), T0 + 1.5))
    if resumed:   # a second segment resumes at step 8: its intervals count from 0 again
        drafter += segment(0, "drafter", drafter_intervals(T0 + 10.0, warm=True), 15, 330.0)
    target = segment(1, "target", target_intervals(), 8, 360.0)
    target.insert(3, flows(1, "transfer.send", T, range(1, 5), T0 + 1.4))
    return {"logs": {0: drafter, 1: target}, "files": throughput_files({0: drafter, 1: target})}


def throughput_files(logs: dict) -> dict:
    """{rank: RUN_DIR/throughput/rank{R}.json}: the fields of the rank's last throughput event."""
    return {rank: {k: v for k, v in [r for r in recs if r.get("kind") == "throughput"][-1].items()
                   if k not in ("type", "kind", "rank", "time_unix")} for rank, recs in logs.items()}


def only_warmup() -> dict:
    """The README's default run at --profile-interval 60: each rank's only interval is both warm-up and final,
    though its throughput meter got past warm-up."""
    logs = {}
    for rank, role, intervals, rate in ((0, "drafter", drafter_intervals()[:1], 350.0),
                                        (1, "target", target_intervals()[:1], 360.0)):
        intervals[0]["final"] = True
        logs[rank] = segment(rank, role, intervals, 7, rate)
    return {"logs": logs, "files": throughput_files(logs)}


def write(run_dir: Path, run: dict) -> Path:
    (run_dir / "profile").mkdir(parents=True)
    (run_dir / "throughput").mkdir()
    for rank, recs in run["logs"].items():
        (run_dir / "profile" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for rank, f in run["files"].items():
        (run_dir / "throughput" / f"rank{rank}.json").write_text(json.dumps(f) + "\n")
    return run_dir


def find(recs: list, kind: str, index: int | None = None) -> dict:
    """The first record of type (or event kind) `kind`, with interval `index` when given."""
    return next(r for r in recs if kind in (r["type"], r.get("kind")) and (index is None or r.get("index") == index))


# ---- a clean run ----------------------------------------------------------------------------------

@pytest.mark.parametrize("resumed", [False, True], ids=["one segment", "resumed"])
def test_a_clean_run_keeps_every_invariant(tmp_path, resumed):
    res = check(write(tmp_path / "run", clean(resumed)))
    assert res.violations == []
    assert res.ranks == 2 and res.intervals == (9 if resumed else 6) and res.checked > 100
    assert res.summary() == f"check: {res.checked} invariants over 2 ranks, {res.intervals} intervals: all hold"


def test_an_old_log_is_noted_not_violated(tmp_path):
    """A log written before self time, warm-up marks and throughput events: what it cannot hold is a note."""
    run = clean()
    for recs in run["logs"].values():
        recs[:] = [r for r in recs if r.get("kind") != "throughput"]
        for r in recs:
            r.pop("warmup_steps", None), r.pop("phase_spans", None), r.pop("warmup", None)
            if r["type"] in ("interval", "run_end"):
                for e in r["spans"].values():
                    e["cpu"].pop("self_seconds", None)
    res = check(write(tmp_path / "run", run))
    assert res.violations == []
    assert any("self_seconds" in n for n in res.notes) and any("warmup_steps" in n for n in res.notes)
    assert any("written before throughput events" in n for n in res.notes)


# ---- one broken invariant at a time -----------------------------------------------------------------

def _drafter(run, kind, index=None):
    return find(run["logs"][0], kind, index)


def _set(path_fn, key, value):
    def edit(run):
        path_fn(run)[key] = value
    return edit


def _more_optim(run):
    """drafter.optim given 0.45 s (its run_end too): with drafter.fwd_bwd's 0.6 s and drafter.recv's 0.3 s on
    the same thread, 1.35 s of self time in a 1 s interval, though each share is below 1."""
    e = _drafter(run, "interval", 1)["spans"]["drafter.optim"]
    e["cpu"]["total_seconds"] = e["cpu"]["self_seconds"] = e["share"] = 0.45
    end = _drafter(run, "run_end")["spans"]["drafter.optim"]["cpu"]
    end["total_seconds"] = end["self_seconds"] = 0.45


def _lag(n: int, launch: int, unplaced: int = 0) -> dict:
    return {"n": n, "launch_bound": launch, "gpu_bound": 0, "unplaced": unplaced, "tolerance_s": 5e-5,
            "start_lag_p50_s": 4e-6, "end_lag_p50_s": 9e-6, "window_seconds": 0.21, "tail_seconds": 0.0}


def _launch_bound_beyond_its_host_time(run):
    """drafter.fwd_bwd of interval 1 all launch-bound (4 of 4), its CPU spans 0.04 s each: 0.16 s on the host
    against a 0.21 s GPU window."""
    e = _drafter(run, "interval", 1)["spans"]["drafter.fwd_bwd"]
    e["gpu_lag"], e["cpu"]["mean_seconds"] = _lag(4, 4), 0.04


BROKEN = {
    "a GPU-timed span neither placed nor counted unplaced": (
        _set(lambda r: _drafter(r, "interval", 1)["spans"]["drafter.fwd_bwd"], "gpu_lag", _lag(3, 3)),
        "gpu", "rank0.jsonl (drafter) interval 1 span drafter.fwd_bwd"),
    "a launch-bound span's GPU window beyond its host time": (
        _launch_bound_beyond_its_host_time, "gpu", "rank0.jsonl (drafter) interval 1 span drafter.fwd_bwd"),
    "an interval share above 1": (
        _set(lambda r: _drafter(r, "interval", 1)["spans"]["drafter.optim"], "share", 1.2),
        "shares", "rank0.jsonl (drafter) interval 1 span drafter.optim"),
    "self time above the interval on a thread": (
        _more_optim, "shares", "interval 1 thread drafter.main"),
    "p50 above p95": (
        _set(lambda r: _drafter(r, "interval", 1)["spans"]["drafter.fwd_bwd"]["cpu"], "p95_seconds", 0.01),
        "order", "interval 1 span drafter.fwd_bwd cpu"),
    "a GPU mean above its max (the compile outlier scaled)": (
        _set(lambda r: _drafter(r, "interval", 0)["spans"]["drafter.fwd_bwd"]["gpu"], "mean_seconds", 2.8),
        "order", "interval 0 span drafter.fwd_bwd gpu"),
    "a negative count": (
        _set(lambda r: _drafter(r, "interval", 2)["spans"]["drafter.fwd_bwd"], "gpu_unresolved", -1),
        "order", "interval 2 span drafter.fwd_bwd"),
    "the throughput file apart from its event": (
        _set(lambda r: r["files"][0], "steady_tokens_per_s", 350.0 + 1e-9), "agree", "throughput/rank0.json"),
    "run_end counting a span its intervals do not": (
        _set(lambda r: _drafter(r, "run_end")["spans"]["drafter.optim"], "count", 5),
        "agree", "segment 0 run_end span drafter.optim"),
    "run_end CPU time its intervals do not hold": (
        _set(lambda r: _drafter(r, "run_end")["spans"]["drafter.recv"]["cpu"], "total_seconds", 0.7),
        "agree", "segment 0 run_end span drafter.recv"),
    "a run_end counter apart from its intervals": (
        _set(lambda r: _drafter(r, "run_end")["counters"]["tokens"], "total", 801),
        "agree", "segment 0 run_end counter tokens"),
    "GPU time counted beyond the rank's wall": (   # the report's row, over the same time, says so too
        _set(lambda r: _drafter(r, "interval", 2)["spans"]["drafter.fwd_bwd"]["gpu"], "total_seconds", 2.5),
        ("once", "shares", "gpu"), "rank0.jsonl (drafter) span drafter.fwd_bwd"),   # gpu: launch-bound there
    "a child's self time above its total": (
        _set(lambda r: _drafter(r, "interval", 0)["spans"]["drafter.compile"]["cpu"], "self_seconds", 0.61),
        "once", "interval 0 span drafter.compile cpu"),
    "a warm-up interval not marked": (
        lambda r: _drafter(r, "interval", 0).pop("warmup"), "phases", "segment 0 interval 0"),
    "a phase span not listed": (
        _set(lambda r: _drafter(r, "run_start"), "phase_spans", [p for p in PHASES if p != "ckpt.save"]),
        "phases", "segment 0 span ckpt.save"),
    "flows without their receives": (
        lambda r: r["logs"][0].remove(_drafter(r, "spans")), "flows", "merged trace"),
    "flows pointing backwards in time": (   # every receive ends before its send began
        lambda r: r["logs"][0].__setitem__(4, flows(0, "drafter.recv", D, range(1, 5), T0 + 1.0)),
        "flows", "merged trace"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_broken_invariant_is_named_where_it_breaks(tmp_path, case):
    edit, invariants, where = BROKEN[case]
    invariants = (invariants,) if isinstance(invariants, str) else invariants
    run = clean()
    edit(run)
    found = check_run(write(tmp_path / "run", run))
    assert {v.invariant for v in found} == set(invariants), [str(v) for v in found]
    assert any(v.invariant == invariants[0] and where in v.where for v in found), [str(v) for v in found]


def test_the_phases_checked_are_those_of_the_run_start_span_table(tmp_path):
    """A run_start with a span_table: each span the table calls a phase must be listed in phase_spans, and only
    those (an older log's phases are FALLBACK's, as every other case here)."""
    run = clean()
    start = _drafter(run, "run_start")
    shown = {n for r in run["logs"][0] if r["type"] == "interval" for n in r["spans"]}
    assert {"drafter.fwd_bwd", "drafter.compile"} <= shown
    start["span_table"] = {"drafter.fwd_bwd": {"role": "drafter", "kind": "phase"},
                           "drafter.compile": {"role": "drafter", "kind": "work"}}
    start["phase_spans"] = []
    found = [str(v) for v in check_run(write(tmp_path / "run", run)) if v.invariant == "phases"]
    assert found == ["phases: profile/rank0.jsonl (drafter) segment 0 span drafter.fwd_bwd: a phase span not listed "
                     "in run_start phase_spans"], found


def test_a_drafter_past_warmup_without_a_throughput_event(tmp_path):
    run = clean()
    run["logs"][0].remove(_drafter(run, "throughput"))
    del run["files"][0]
    found = check_run(write(tmp_path / "run", run))
    assert [(v.invariant, v.where) for v in found] == [("phases", "profile/rank0.jsonl (drafter) segment 0")]
    assert "no throughput event" in found[0].message


def test_a_resumed_run_checks_each_segment_against_its_own_run_end(tmp_path):
    run = clean(resumed=True)
    second = [r for r in run["logs"][0] if r["type"] == "run_end"][1]
    second["spans"]["drafter.fwd_bwd"]["count"] += 1
    found = check_run(write(tmp_path / "run", run))
    assert [(v.invariant, v.where) for v in found] == [
        ("agree", "profile/rank0.jsonl (drafter) segment 1 run_end span drafter.fwd_bwd")]


def test_the_report_rows_and_rates_are_checked(tmp_path, monkeypatch):
    """A report row out of order and over its thread, and a per-role steady rate apart from its files."""
    real = check_mod.hotspots_of

    def skewed(run):
        rep = copy.deepcopy(real(run))
        row = next(r for r in rep["spans"]["rows"] if r["span"] == "target.fwd")
        row["share"], row["p50_seconds"] = 1.5, row["max_seconds"] * 2
        rep["steady"]["roles"]["drafter"]["steady_tokens_per_s"] *= 1.02
        return rep

    monkeypatch.setattr(check_mod, "hotspots_of", skewed)
    found = {(v.invariant, v.where) for v in check_run(write(tmp_path / "run", clean()))}
    assert found == {("shares", "hotspots row target target.fwd"), ("order", "hotspots row target target.fwd"),
                     ("agree", "hotspots steady drafter"), ("agree", "hotspots steady_tokens_per_s")}


def test_a_one_rank_roles_percentiles_are_its_run_ends(tmp_path, monkeypatch):
    """The report's p50 of a span of a one-rank, one-segment role is the run_end's exact one, the figure the
    console's end-of-run table prints; a report that interpolated another is caught."""
    run_dir = write(tmp_path / "run", clean())
    optim = next(r for r in check_mod.hotspots_of(load_run(run_dir))["spans"]["rows"] if r["span"] == "drafter.optim")
    assert (optim["p50_seconds"], optim["quantiles_from"]) == (0.02, "exact")
    from profiler import report
    text = report.format_hotspots(report.hotspots(run_dir))
    assert "p50 and p95 of 4 span(s) are estimates over several ranks, segments or intervals" in text
    real = check_mod.hotspots_of

    def interpolated(run):
        rep = copy.deepcopy(real(run))
        next(r for r in rep["spans"]["rows"] if r["span"] == "drafter.optim")["p50_seconds"] = 0.015
        return rep

    monkeypatch.setattr(check_mod, "hotspots_of", interpolated)
    assert [(v.invariant, v.where) for v in check_run(run_dir)] == [("agree", "hotspots row drafter drafter.optim")]


# ---- windows: a figure named steady is read over steady intervals ------------------------------------

def test_a_run_with_no_steady_interval_names_its_window_on_every_surface(tmp_path):
    """Issue 33: the README's default run at --profile-interval 60 has one interval, warm-up and final. Every
    surface names the window its figures were read over (no "steady intervals"), the rate column is the
    throughput file's, and the check holds."""
    from profiler import report

    run_dir = write(tmp_path / "run", only_warmup())
    assert check(run_dir).violations == []
    rep = report.hotspots(run_dir)
    only = "the only interval (none steady: warm-up, phases or final)"
    assert {r["window"] for r in rep["verdict"]["roles"].values()} == {only}
    assert [(r["window"], r["steady_tokens_per_s"]) for r in rep["ranks"]["ranks"]] == [(only, 350.0), (only, 360.0)]
    text = report.format_hotspots(rep)
    assert f"Verdict (drafter: {only}, 1 s; target: {only}, 1 s)" in text and "steady intervals" not in text
    assert f"ok; tokens/s over steady state, 2.0 s; busy, capacity over {only}, 1.0 s" in text and "      350 " in text
    table = report.compare(run_dir, run_dir)
    assert table["role_windows"] == {role: {"a": only, "b": only} for role in ("drafter", "target")}
    assert f"  drafter: A over {only}; B over {only}" in report.format_compare(table)


def test_a_run_without_warm_up_steps_is_steady_from_its_first_interval(tmp_path):
    """warmup_steps 0 (a run of under 4 steps): no interval is warm-up, so the first is steady, as the meter's
    window starts with the loop; the report read it as start-up (a run two real tests make)."""
    from profiler import report

    run = clean()
    for recs in run["logs"].values():
        for r in recs:
            r.pop("warmup", None)
            if r["type"] == "run_start":
                r["warmup_steps"] = 0
    run_dir = write(tmp_path / "run", run)
    assert check(run_dir).violations == []
    # the drafter's first interval compiles for 0.6 of its 1 s: a phase interval, not steady
    assert [r["window"] for r in report.hotspots(run_dir)["ranks"]["ranks"]] == ["steady intervals (1)",
                                                                                "steady intervals (2)"]


def test_an_interval_mostly_in_a_phase_is_not_steady(tmp_path, monkeypatch):
    """Issue 33 on an H100: intervals spent whole in a checkpoint (an 8B-shaped drafter's ckpt.save took 21.6 s)
    or in evaluation were called steady, so the verdict's GPM and wait figures averaged the phase in. An
    interval past warm-up with a checkpoint open for 0.9 of its 1 s is a phase interval: left out of every steady
    window, and a report that kept it is caught."""
    from profiler import report
    from profiler.report import runs

    ivs = drafter_intervals()
    ivs[1].pop("warmup")
    ckpt = interval(0, "drafter", 2, 8, {"ckpt.save": entry([], D, total=0.9, open_s=0.9)}, 0, T0)
    final = {**ivs[2], "index": 3, "time_unix": ivs[2]["time_unix"] + 1.0}
    final["spans"] = {**final["spans"], "ckpt.save": entry([1.0], D, total=0.1)}
    drafter = segment(0, "drafter", [ivs[0], ivs[1], ckpt, final], 7, 350.0)
    target = segment(1, "target", target_intervals(), 8, 360.0)
    logs = {0: drafter, 1: target}
    run_dir = write(tmp_path / "run", {"logs": logs, "files": throughput_files(logs)})
    assert check(run_dir).violations == []
    rows = report.hotspots(run_dir)["ranks"]["ranks"]
    assert [r["window"] for r in rows] == ["steady intervals (1)"] * 2 and rows[0]["window_seconds"] == 1.0

    monkeypatch.setattr(runs, "is_steady", lambda rec, phases: not rec.get("warmup") and not rec.get("final"))
    found = {(v.invariant, v.where) for v in check_run(run_dir)}
    assert {("windows", "hotspots ranks rank 0"), ("windows", "hotspots verdict drafter")} <= found, found


def test_a_window_labelled_steady_over_warmup_is_a_violation(tmp_path, monkeypatch):
    """The fault issue 33 found: figures read over warm-up (the silent fallback) labelled steady."""
    from profiler.report import runs

    monkeypatch.setattr(runs.Window, "label", property(lambda w: f"steady intervals ({len(w.intervals)})"))
    found = {(v.invariant, v.where) for v in check_run(write(tmp_path / "run", only_warmup()))}
    assert found == {("windows", "hotspots ranks rank 0"), ("windows", "hotspots ranks rank 1"),
                     ("windows", "hotspots verdict drafter"), ("windows", "hotspots verdict target"),
                     *{("compare", f"compare {role} {side}") for role in ("drafter", "target") for side in "AB"}}


def test_the_ranks_table_must_show_the_throughput_files_rate(tmp_path, monkeypatch):
    """The other fault: the ranks table's tokens/s read over the intervals (2% off the steady state's)."""
    from profiler.report import report_text

    def interval_rates(rep):
        rep = copy.deepcopy(rep)
        for row in rep["ranks"]["ranks"]:
            row["tokens_per_s"] *= 0.98
        return report_text.format_hotspots(rep)

    monkeypatch.setattr(check_mod, "format_hotspots", interval_rates)
    found = {(v.invariant, v.where) for v in check_run(write(tmp_path / "run", only_warmup()))}
    assert found == {("agree", "hotspots text ranks rank 0"), ("agree", "hotspots text ranks rank 1")}


def test_no_window_label_beside_another_windows_figure_in_the_ranks_table(tmp_path, monkeypatch):
    """Issue 45: the steady state's rate (over the meter's seconds) printed beside the steady intervals' label,
    whose own rate differs. Each figure of a row names its own window, and check finds a row that does not."""
    from profiler import report
    from profiler.report import report_text

    run_dir = write(tmp_path / "run", clean())
    rep = report.hotspots(run_dir)
    row = rep["ranks"]["ranks"][1]
    line = next(x for x in report.format_hotspots(rep).splitlines() if x.split()[:2] == ["1", "target"])
    assert row["window"] == "steady intervals (1)"
    assert row["tokens_window"] == "steady state" and row["tokens_window_seconds"] == 2.0
    assert line.endswith(f"tokens/s over steady state, 2.0 s; busy, capacity over {row['window']}, "
                         f"{row['window_seconds']:.1f} s")
    assert row["capacity_tokens_per_s"] == pytest.approx(row["window_tokens_per_s"] / row["work_share"])
    assert row["window_tokens_per_s"] != pytest.approx(row["tokens_per_s"], rel=0.01)   # two windows, two rates

    def one_label(rep):   # the old row: the meter's rate, only the steady intervals' label at its end
        return report_text.format_hotspots(rep).replace("tokens/s over steady state, 2.0 s; busy, capacity over ",
                                                         "")

    monkeypatch.setattr(check_mod, "format_hotspots", one_label)
    found = {(v.invariant, v.where) for v in check_run(run_dir)}
    assert found == {("windows", "hotspots text ranks rank 0"), ("windows", "hotspots text ranks rank 1")}


def test_a_rank_without_its_meter_says_so_instead_of_another_rate(tmp_path):
    """A target that wrote no throughput event: no rate, no capacity, a reason; never its intervals' rate."""
    from profiler import report

    run = only_warmup()
    run["logs"][1] = [r for r in run["logs"][1] if r.get("kind") != "throughput"]
    del run["files"][1]
    run_dir = write(tmp_path / "run", run)
    assert check(run_dir).violations == []
    row = report.hotspots(run_dir)["ranks"]["ranks"][1]
    assert (row["steady_tokens_per_s"], row["capacity_tokens_per_s"]) == (None, None)
    text = report.format_hotspots(report.hotspots(run_dir))
    assert "  rank 1: no steady tokens/s: no throughput event (a run stopped during warm-up" in text


# ---- the CLI ----------------------------------------------------------------------------------------

def test_cli_exit_codes(tmp_path, capsys):
    good = write(tmp_path / "good", clean())
    assert report_cli.main(["check", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].endswith("over 2 ranks, 6 intervals: all hold")
    bad_run = clean()
    BROKEN["p50 above p95"][0](bad_run)
    BROKEN["a phase span not listed"][0](bad_run)
    bad = write(tmp_path / "bad", bad_run)
    assert report_cli.main(["check", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("check: order: ") and lines[1].startswith("check: phases: ")
    assert report_cli.main(["check", str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and [v["invariant"] for v in doc["violations"]] == ["order", "phases"]
    assert report_cli.main(["check", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such directory" in err[0]


# ---- the plot ---------------------------------------------------------------------------------------

def test_plot_stacks_self_time_so_a_child_never_sits_on_its_parent(tmp_path):
    """drafter.compile (0.6 s) inside drafter.fwd_bwd (0.85 s): stacked, the two hold the parent's 0.85 s,
    not 1.45 s; every stack fits in its 1 s interval; the first interval starts where the run's did."""
    run = load_run(write(tmp_path / "run", clean()))
    role = timeline(run)["roles"]["drafter"]
    first = {name: values[0] for name, values in role["spans"].items()}
    assert first["drafter.fwd_bwd"] + first["drafter.compile"] == pytest.approx(0.85)
    assert all(sum(v[k] for v in role["spans"].values()) <= 1.0 + 1e-9 for k in range(len(role["seconds"])))
    assert role["start_seconds"] == pytest.approx(0.0) and role["seconds"][0] == pytest.approx(1.0)


def test_plot_draws_the_first_interval(tmp_path):
    pytest.importorskip("matplotlib")
    from profiler import report

    png = tmp_path / "run.png"
    assert report.plot(write(tmp_path / "run", clean()), png) == str(png) and png.stat().st_size > 0


# ---- the suite's shared real run --------------------------------------------------------------------

@pytest.mark.slow
def test_the_shared_healthy_run_keeps_every_invariant(healthy_run):
    assert healthy_run.returncode == 0, healthy_run.stderr[-3000:]
    assert [str(v) for v in check_run(healthy_run.run)] == []
