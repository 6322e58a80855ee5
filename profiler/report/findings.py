"""Findings: the few things in a report worth acting on, each with its evidence (window and sample count
said) and the next experiment. The rules here decide what is found and say its evidence; how the next experiment
is said is an `Advice`, passed in: this module's, in the profiler's terms with no flags (a loop of its own has no
command line of ours), or a trainer's (dflash/advice.py: dflash-train's flags, and the pipeline's own rules), whose
`flags` are the ones its `next` names, added to the run's own."""
from __future__ import annotations

FLOOR_RATIO_LOW = 0.25         # a span moving its bytes at under a quarter of the floor's bandwidth
FLOOR_LOSS_SHARE = 0.01        # ... and losing at least this share of its role's time to it
LOW_HEADROOM_SHARE = 0.05
PROFILER_SHARE_HIGH = 0.02     # the profiler's threads using over 2% of a rank's wall time in CPU
LAUNCH_SHARE_MIN = 0.05       # a launch-bound span holding at least this share of its role's time is a finding
GIB = 1024 ** 3
LAUNCH_FIXES = "fewer and larger kernels (fuse small ops), CUDA graphs for the step, torch.compile"


def finding(kind: str, summary: str, evidence: str, next_: str, flags: list | None = None) -> dict:
    """One finding as the report holds it (docs/REPORT.md `findings`)."""
    return {"kind": kind, "summary": summary, "evidence": evidence, "next": next_, "flags": list(flags or [])}


NEXT_FOR_EVENT = {
    "thread_crash": "read the traceback in the event, fix, and rerun to that step",
    "hang": "take dflash-profile snapshot --run-dir while it stalls and read which span each thread holds",
    "bad_records": "fix or drop the data lines the event names (its path and count)",
    "run_failed": "read the process's stderr and its last event",
    "no_run_end": "the rank died without closing its log: check the host's OOM killer (dmesg) and the launcher's "
                  "output",
    "bad_lines": "a truncated last line is a crash's signature: see run_failed / no_run_end",
    "nonfinite": "check the tensors of the spans before it with profiler.check_finite(span, {name: tensor}) and rerun "
                 "to that step: the first span that produced a NaN/Inf is named",
    "signal": "nothing to fix if the stop was intended",
}
"""The next experiment for each event kind a report calls a problem, in the profiler's terms."""


class Advice:
    """How each finding says its next experiment (next, flags): in the profiler's terms, with no flags, for a loop
    of its own. A trainer passes its own subclass to report.hotspots (dflash/advice.py): its command line's flags,
    and `rules`, the findings' rules in order, its own among them."""

    stall_hint = ""
    """Said after a stall's next: where a stall that is not one shows."""

    @property
    def rules(self) -> tuple:
        """The rules, problems first: each reads the assembled report and this advice and returns its findings."""
        return RULES

    def for_report(self, report: dict) -> "Advice":
        """The advice that fits this report (a trainer's advises only on its own runs)."""
        return self

    def copy(self, report: dict, span: str) -> tuple[str, list]:
        """A copy far below its path's floor."""
        return "time the copy alone at this size against the floor", []

    def smaller_batch(self, report: dict) -> tuple[str, list]:
        """The allocator retried, or ran out of memory."""
        return "lower the batch size", []

    def less_memory(self, report: dict) -> tuple[str, list]:
        """A GPU's headroom fell low."""
        return "lower the batch size, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", []

    def larger_batch(self, report: dict) -> tuple[str, list]:
        """Launch-bound spans: fewer, larger kernels or a larger batch."""
        return f"{LAUNCH_FIXES}, or a larger batch", []

    def memory_history(self) -> tuple[str, list]:
        """How to keep the allocator's history for an out-of-memory error: the setting, and its flags."""
        return "ProfilerConfig(memory_history=100000)", []

    def event(self, report: dict, kind: str, first: dict) -> tuple[str, list]:
        """A problem event of `kind`, its first example `first`."""
        if kind == "oom":
            nxt, flags = self.smaller_batch(report)
            return nxt + ", and read the OOM record's active spans and headroom history", flags
        return NEXT_FOR_EVENT.get(kind, "read the event record"), []

    def profiler_cost(self, report: dict) -> tuple[str, list]:
        """The profiler's own threads cost over PROFILER_SHARE_HIGH of a rank's time."""
        return ("raise ProfilerConfig(interval_s=...), keep only the sinks someone reads in exporters.build(...), and "
                "see the interval records' threads_cpu_seconds for the thread that costs it", [])


def _launch_bound_spans(report: dict) -> set:
    """{(role, span)} the spans table calls launch-bound (profiler.schema.windows.gpu_bound): their time is launches."""
    return {(r["role"], r["span"]) for r in report["spans"]["rows"]
            if (r.get("gpu_bound") or {}).get("class") == "launch-bound"}


def bandwidth(report: dict, advice: Advice) -> list:
    """Copies far below their path's floor, except launch-bound ones: their time is launch overhead, not bytes."""
    walls = {role: r["wall_seconds"] for role, r in report["spans"]["roles"].items()}
    launch = _launch_bound_spans(report)
    out = []
    for b in report["bandwidth"]:
        wall = walls.get(b["role"]) or 0.0
        lost = b["seconds_over_floor"]
        if b["floor_ratio"] is None or b["floor_ratio"] >= FLOOR_RATIO_LOW or not wall \
                or lost < FLOOR_LOSS_SHARE * wall or (b["role"], b["span"]) in launch:
            continue
        out.append(finding(
            "below_floor", f"{b['span']} ({b['role']}) moves its bytes at {b['floor_ratio'] * 100:.2g}% of the "
                           f"{b['floor']} floor over the whole run",
            f"whole run: {b['bytes'] / 1e9:.3g} GB in {b['seconds']:.3g} s = {b['bandwidth_bytes_per_s'] / 1e9:.3g} "
            f"GB/s vs {b['floor_bytes_per_s'] / 1e9:.3g} GB/s measured at start; {lost:.3g} s over the floor "
            f"({lost / wall:.1%} of the {b['role']}'s whole-run time)", *advice.copy(report, b["span"])))
    return out


def launch_bound(report: dict, advice: Advice) -> list:
    """One finding per role whose launch-bound spans hold at least LAUNCH_SHARE_MIN of its time each."""
    by_role: dict = {}
    for r in report["spans"]["rows"]:
        g = r.get("gpu_bound") or {}
        if g.get("class") == "launch-bound" and (r["share"] or 0.0) >= LAUNCH_SHARE_MIN and not r["wait"]:
            by_role.setdefault(r["role"], []).append(r)
    out = []
    for role, rows in by_role.items():
        names = ", ".join(r["span"] for r in rows)
        evidence = "; ".join(_launch_evidence(r) for r in rows)
        nxt, flags = advice.larger_batch(report)
        out.append(finding("launch_bound", f"{names} ({role}) {'is' if len(rows) == 1 else 'are'} launch-bound: the "
                                            "GPU keeps pace with the host's kernel launches and idles between them",
                            "whole run: " + evidence, nxt, flags))
    return out


def _launch_evidence(r: dict) -> str:
    g = r["gpu_bound"]
    only = ": its steps only" if g["busy_source"] == "capture" else ""
    busy = "" if g["busy_share"] is None else f", busy {g['busy_share']:.0%} ({g['busy_source']}{only})"
    lag = "-" if g["end_lag_p50_s"] is None else f"{g['end_lag_p50_s'] * 1e6:.0f} us"
    return (f"{r['span']}: GPU window {r['gpu_window_seconds'] or 0.0:.3g} s against {r['cpu_seconds']:.3g} s on the "
            f"host, {r['share']:.0%} of the {r['role']}'s time; {g['launch_bound_share']:.0%} of {g['samples']} spans "
            f"ended on the GPU within a launch latency of the host (median end lag {lag}){busy}")


def allocator(report: dict, advice: Advice) -> list:
    """A finding for the ranks whose allocator retried, one per allocator series that leaks (memory_trend)."""
    allocs = report["memory"]["allocator"]
    retried = [a for a in allocs if (a["alloc_retries_last"] or 0) > 0]
    out = []
    if retried:
        nxt, flags = advice.smaller_batch(report)
        out.append(finding(
            "alloc_retries", f"the allocator retried cudaMalloc on {len(retried)} rank(s)",
            "; ".join(f"rank {a['rank']} ({a['role']}): num_alloc_retries {a['alloc_retries_first'] or 0} at the "
                      f"first interval, {a['alloc_retries_last']} at the last (whole run, {a['intervals']} "
                      "intervals)" for a in retried) + ": it freed its cache to fit",
            f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or {nxt}", flags))
    out += [_leak(a, t, advice) for a in allocs for t in (a.get("trends") or {}).values() if t["leak"]]
    return out


def _leak(a: dict, t: dict, advice: Advice) -> dict:
    what = t["series"].replace("_bytes", "")
    first, last = t["intervals"]
    history, flags = advice.memory_history()
    exhaust = (f"; at this slope the {t['headroom_bytes'] / GIB:.1f} GiB headroom of the last interval is gone in "
               f"{t['seconds_to_exhaust'] / 60:.0f} min (the run so far: {t['run_seconds'] / 60:.0f} min)"
               if t["seconds_to_exhaust"] is not None else "")
    return finding(
        "memory_leak", f"{what} memory on rank {a['rank']} ({a['role']}) climbs "
                       f"{t['slope_bytes_per_s'] * 60 / GIB:.3g} GiB/min after warm-up",
        f"{t['window']}, intervals {first}-{last} ({t['samples']} samples, "
        f"{t['window_seconds'] / 60:.1f} min): Theil-Sen slope {t['slope_bytes_per_s'] * 60 / GIB:.3g} GiB/min, "
        f"{t['first_bytes'] / GIB:.2f} -> {t['last_bytes'] / GIB:.2f} GiB, rise {t['rise_bytes'] / GIB:.2f} GiB "
        f"({t['rise_bytes'] / t['total_bytes']:.1%} of the GPU's {t['total_bytes'] / GIB:.0f} GiB) against a "
        f"residual MAD of {t['mad_bytes'] / GIB:.3f} GiB{exhaust}",
        "look for tensors kept across steps (buffers held for in-flight transfers, lists of losses); rerun with "
        f"{history} so an out-of-memory error leaves the allocator's history under RUN_DIR/forensics/", flags)


STALL_INTERVALS = 3            # a rank's last intervals with no finished span: a stall


def stalls(report: dict, advice: Advice) -> list:
    stalled = [r for r in report["ranks"]["ranks"] if r["stalled_intervals"] >= STALL_INTERVALS]
    if not stalled:
        return []
    return [finding("stalled", "no span finished on " + ", ".join(f"rank {r['rank']} ({r['role']})" for r in stalled)
                     + " at the end of the log",
                     "; ".join(f"rank {r['rank']}: its last {r['stalled_intervals']} intervals "
                               f"({r['stalled_seconds']:.0f} s) at step {r['steps']}" for r in stalled),
                     "while it stalls, dflash-profile snapshot --run-dir shows the span each thread holds open and "
                     "its stack" + advice.stall_hint)]


def straggler(report: dict, advice: Advice) -> list:
    s = report["ranks"]["straggler"]
    if not s:
        return []
    where = (f"; its {s['span']} costs {s['span_seconds_per_token'] * 1e6:.1f} us/token vs "
             f"{s['peers_span_seconds_per_token'] * 1e6:.1f} us/token on its peers" if s.get("span") else "")
    return [finding("straggler",
                     f"rank {s['rank']} ({s['role']}) is {1 - s['capacity_ratio']:.0%} slower than its peers",
                     f"capacity (tokens/s over the work share, both over its {s['window']}) "
                     f"{s['capacity_tokens_per_s']:.4g} tokens/s vs the peers' median "
                     f"{s['peers_median_tokens_per_s']:.4g}{where}",
                     "compare its GPU's clocks and throttle reasons, then swap its GPU with a peer's "
                     "(CUDA_VISIBLE_DEVICES) to tell the device from the rank's work")]


def headroom(report: dict, advice: Advice) -> list:
    out = []
    for g in report["memory"]["gpus"]:
        low = g["low_point"]
        if low["headroom_ratio"] >= LOW_HEADROOM_SHARE:
            continue
        when = f" at +{low['seconds_since_start']:.0f} s" if low["seconds_since_start"] is not None else ""
        nxt, flags = advice.less_memory(report)
        out.append(finding(
            "low_headroom", f"gpu {g['gpu']} fell to {low['headroom_ratio']:.1%} headroom during "
            f"{low['dominant_span']} (the interval's dominant span)",
            f"the whole run's low point over {g['intervals']} interval records: {low['headroom_bytes'] / GIB:.2f} GiB free "
            f"of {g['total_bytes'] / GIB:.1f} GiB{when}, rank {low['rank']} interval {low['interval']} step "
            f"{low['step']}", nxt, flags))
    for g in report["memory"]["gpus"]:
        for reason, n in g.get("throttle_intervals", {}).items():
            if reason not in ("gpu_idle", "applications_clocks_setting"):
                out.append(finding("throttled", f"gpu {g['gpu']} reported clock reason {reason} in {n} intervals",
                                    f"NVML throttle_reasons in {n} of the whole run's {g['intervals']} interval records",
                                    "check cooling and power caps (nvidia-smi -q -d PERFORMANCE)"))
    return out


def _where(example: dict) -> str:
    keys = ("rank", "span", "step", "last_step", "status", "signal", "reason", "path", "count", "lines", "message",
            "error")
    return ", ".join(f"{k} {example[k]}" for k in keys if example.get(k) is not None)


def events(report: dict, advice: Advice) -> list:
    ev = report["events"]
    out = []
    for kind in ev["problems"]:
        k = ev["kinds"][kind]
        first = k["examples"][0] if k["examples"] else {}
        out.append(finding(kind, f"{k['count']} {kind} on rank{'s' if len(k['ranks']) > 1 else ''} "
                                  f"{', '.join(map(str, k['ranks']))} over the whole run", f"first: {_where(first)}",
                            *advice.event(report, kind, first)))
    return out


def profiler_cost(report: dict, advice: Advice) -> list:
    costly = [r for r in report["ranks"]["ranks"] if (r.get("profiler_share") or 0.0) > PROFILER_SHARE_HIGH]
    if not costly:
        return []
    return [finding("profiler_cost", f"the profiler's own threads cost {_costly(costly)}", _PROFILER_COST_EVIDENCE,
                     *advice.profiler_cost(report))]


_PROFILER_COST_EVIDENCE = ("CPU seconds of the collector, exporter, NVML, stack and control threads and the "
                           "exporters' over the window's wall time (interval records' profiler_share); under the GIL "
                           "the training thread waits for much of it")


def _costly(rows: list) -> str:
    return ", ".join(f"rank {r['rank']} ({r['role']}) {r['profiler_share']:.1%} of its wall time "
                     f"({r.get('profiler_window', r['window'])})" for r in rows)


RULES = (events, stalls, headroom, allocator, straggler, launch_bound, bandwidth, profiler_cost)
"""The rules of any run, problems first (Advice.rules; a trainer's advice puts its own among them)."""
GENERIC = Advice()
"""The advice of a report made without a trainer's: the profiler's terms."""


def findings(report: dict, advice: Advice) -> list:
    """Every finding of an assembled report (report.hotspots), in the rules' order of the advice that fits it."""
    advice = advice.for_report(report)
    return [f for rule in advice.rules for f in rule(report, advice)]
