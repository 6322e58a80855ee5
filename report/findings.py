"""Findings: the few things in a report worth acting on, each with its evidence (window and sample count
said) and the next experiment. A finding's `flags` are the dflash-train flags its `next` names, added to the
run's own; each is one the trainer accepts on the run's topology (report.advice.run_topology, the trainer's
rules read from dflash/preflight.py and dflash/worker.py, not imported). A loop of its own (report["pipeline"]
false) gets the same findings with a `next` in the profiler's terms and no flags: it has no dflash-train."""
from __future__ import annotations

from report.analysis import WAIT_BOUND_SHARE

FLOOR_RATIO_LOW = 0.25         # a span moving its bytes at under a quarter of the floor's bandwidth
FLOOR_LOSS_SHARE = 0.01        # ... and losing at least this share of its role's time to it
LOW_HEADROOM_SHARE = 0.05
SPLIT_GAIN = 0.10              # a better split must predict at least this much more throughput
PROFILER_SHARE_HIGH = 0.02     # the profiler's threads using over 2% of a rank's wall time in CPU
LAUNCH_SHARE_MIN = 0.05       # a launch-bound span holding at least this share of its role's time is a finding
GIB = 1024 ** 3

_PINNED = "check the host buffer is pinned and the copy non_blocking; compare with bench/nccl_p2p.py"


def _finding(kind: str, summary: str, evidence: str, next_: str, flags: list | None = None) -> dict:
    return {"kind": kind, "summary": summary, "evidence": evidence, "next": next_, "flags": list(flags or [])}


def _loop(report: dict) -> bool:
    """Whether the report is of a loop of its own (no target or drafter rank), whose user has no dflash-train flags."""
    return not report.get("pipeline", True)


def _topology(report: dict) -> dict:
    return report["split"].get("topology") or {}


def _transfer_next(topo: dict) -> tuple[str, list]:
    """The other transfer path, where the trainer accepts it on this run's devices; else why there is none."""
    if topo.get("transfer") == "nccl":
        return "try the host path (--transfer host) and time the bare link with bench/nccl_p2p.py", ["--transfer", "host"]
    if topo.get("nccl_allowed"):
        return ("try the device-to-device path (--transfer nccl) and time the bare link with bench/nccl_p2p.py",
                ["--transfer", "nccl"])
    why = topo.get("nccl_refused") or "the records do not say the run's devices"
    return (f"the host path is the only one here (the NCCL path needs CUDA and one GPU per rank; here: {why}); time "
            "the bare copies with bench/nccl_p2p.py", [])


def _copy_next(report: dict, span: str) -> tuple[str, list]:
    if span == "transfer.send":
        return _transfer_next(_topology(report))
    if span == "target.pack_hidden":
        if report["config"].get("split_fc_layers"):
            return "try --no-split-fc-layers (concatenate on the target, ship one tensor)", ["--no-split-fc-layers"]
        return "try --split-fc-layers (ship the layers, concatenate on the drafter)", ["--split-fc-layers"]
    if span in ("d2h_copy", "h2d_copy"):
        return _PINNED, []
    return "time the copy alone at this size against the floor", []


def _batch_next(report: dict, otherwise: str, loop: str = "lower the batch size") -> tuple[str, list]:
    """Lower --tokens-per-batch to the memory margin where the trainer takes it (>= --max-length); else `otherwise`;
    `loop` for a loop of its own."""
    if _loop(report):
        return loop, []
    margin = report["memory_margin"].get("max_tokens_per_batch")
    max_length = report["config"].get("max_length") or 1
    now = report["config"].get("tokens_per_batch")
    if margin and margin >= max_length and (now is None or margin < now):
        return f"lower --tokens-per-batch to {margin} (the memory margin)", ["--tokens-per-batch", str(margin)]
    if margin is not None and margin < max_length:
        return (f"{otherwise}: the memory margin ({margin} tokens) is under the run's max_length ({max_length}), "
                "the least tokens per batch the trainer takes", [])
    return otherwise, []


def _launch_bound_spans(report: dict) -> set:
    """{(role, span)} the spans table calls launch-bound (profiler.windows.gpu_bound): their time is launches."""
    return {(r["role"], r["span"]) for r in report["spans"]["rows"]
            if (r.get("gpu_bound") or {}).get("class") == "launch-bound"}


def _bandwidth(report: dict) -> list:
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
        out.append(_finding(
            "below_floor", f"{b['span']} ({b['role']}) moves its bytes at {b['floor_ratio'] * 100:.2g}% of the "
                           f"{b['floor']} floor over the whole run",
            f"whole run: {b['bytes'] / 1e9:.3g} GB in {b['seconds']:.3g} s = {b['bandwidth_bytes_per_s'] / 1e9:.3g} "
            f"GB/s vs {b['floor_bytes_per_s'] / 1e9:.3g} GB/s measured at start; {lost:.3g} s over the floor "
            f"({lost / wall:.1%} of the {b['role']}'s whole-run time)", *_copy_next(report, b["span"])))
    return out


def _launch_bound(report: dict) -> list:
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
        nxt, flags = _launch_next(report)
        out.append(_finding("launch_bound", f"{names} ({role}) {'is' if len(rows) == 1 else 'are'} launch-bound: the "
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


def _launch_next(report: dict) -> tuple[str, list]:
    """Fewer, larger kernels; where the memory margin allows, a larger batch (flags)."""
    steps = "fewer and larger kernels (fuse small ops), CUDA graphs for the step, torch.compile"
    if _loop(report):
        return f"{steps}, or a larger batch", []
    margin = report["memory_margin"].get("max_tokens_per_batch")
    now = report["config"].get("tokens_per_batch")
    if margin and now and margin > now:
        return (f"{steps}; or a larger batch: raise --tokens-per-batch to {margin} (the memory margin)",
                ["--tokens-per-batch", str(margin)])
    return f"{steps}; or a larger batch (--tokens-per-batch) where memory allows", []


def _allocator(report: dict) -> list:
    """A finding for the ranks whose allocator retried, one per allocator series that leaks (memory_trend)."""
    allocs = report["memory"]["allocator"]
    retried = [a for a in allocs if (a["alloc_retries_last"] or 0) > 0]
    out = []
    if retried:
        nxt, flags = _batch_next(report, "lower the tokens per batch")
        out.append(_finding(
            "alloc_retries", f"the allocator retried cudaMalloc on {len(retried)} rank(s)",
            "; ".join(f"rank {a['rank']} ({a['role']}): num_alloc_retries {a['alloc_retries_first'] or 0} at the "
                      f"first interval, {a['alloc_retries_last']} at the last (whole run, {a['intervals']} "
                      "intervals)" for a in retried) + ": it freed its cache to fit",
            f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or {nxt}", flags))
    out += [_leak(a, t, _loop(report)) for a in allocs for t in (a.get("trends") or {}).values() if t["leak"]]
    return out


def _leak(a: dict, t: dict, loop: bool) -> dict:
    what = t["series"].replace("_bytes", "")
    first, last = t["intervals"]
    exhaust = (f"; at this slope the {t['headroom_bytes'] / GIB:.1f} GiB headroom of the last interval is gone in "
               f"{t['seconds_to_exhaust'] / 60:.0f} min (the run so far: {t['run_seconds'] / 60:.0f} min)"
               if t["seconds_to_exhaust"] is not None else "")
    return _finding(
        "memory_leak", f"{what} memory on rank {a['rank']} ({a['role']}) climbs "
                       f"{t['slope_bytes_per_s'] * 60 / GIB:.3g} GiB/min after warm-up",
        f"{t['window']}, intervals {first}-{last} ({t['samples']} samples, "
        f"{t['window_seconds'] / 60:.1f} min): Theil-Sen slope {t['slope_bytes_per_s'] * 60 / GIB:.3g} GiB/min, "
        f"{t['first_bytes'] / GIB:.2f} -> {t['last_bytes'] / GIB:.2f} GiB, rise {t['rise_bytes'] / GIB:.2f} GiB "
        f"({t['rise_bytes'] / t['total_bytes']:.1%} of the GPU's {t['total_bytes'] / GIB:.0f} GiB) against a "
        f"residual MAD of {t['mad_bytes'] / GIB:.3f} GiB{exhaust}",
        "look for tensors kept across steps (buffers held for in-flight transfers, lists of losses); rerun with "
        + ("ProfilerConfig(memory_history=100000)" if loop else "--memory-history 100000")
        + " so an out-of-memory error leaves the allocator's history under RUN_DIR/forensics/",
        [] if loop else ["--memory-history", "100000"])


def _more_drafter(report: dict) -> tuple[str, list]:
    """What to do about a slow drafter, given the split advice and the run's GPUs."""
    sp, topo = report["split"], _topology(report)
    best, now = sp.get("best"), sp.get("current")
    if best and now and (best["target_gpus"], best["drafter_gpus"]) != (now["target_gpus"], now["drafter_gpus"]):
        return (f"move GPUs to the drafters: the split advice for {sp['n_gpus']} GPUs says "
                f"--target-gpus {best['target_gpus']} --drafter-gpus {best['drafter_gpus']}",
                ["--target-gpus", str(best["target_gpus"]), "--drafter-gpus", str(best["drafter_gpus"])])
    if best:
        return (f"no split of {sp['n_gpus']} GPUs does better: make the drafter's step cheaper, or add a drafter GPU "
                f"(dflash-report hotspots --gpus {sp['n_gpus'] + 1} shows that split)", [])
    if topo.get("ranks_share_gpus"):
        return ("the ranks share a GPU, so no split applies: make the drafter's step cheaper, or give each rank its "
                f"own GPU (dflash-report hotspots --gpus {max(2, topo.get('ranks') or 2)} predicts that split)", [])
    return "make the drafter's step cheaper (on GPUs, dflash-report hotspots --gpus N predicts the split)", []


def _waits(report: dict) -> list:
    v = report["verdict"]
    target = v["roles"].get("target") or {}
    wait = target.get("wait_share")
    if wait is None or wait < WAIT_BOUND_SHARE:
        return []
    in_flight = report["config"].get("max_in_flight")
    if v["verdict"] == "transfer-bound":
        nxt = (f"raise --max-in-flight from {in_flight} to {2 * in_flight}" if in_flight
               else "raise --max-in-flight to 4") + " and check transfer.send's bandwidth against its floor"
        flags = ["--max-in-flight", str(2 * in_flight if in_flight else 4)]
    else:
        nxt, flags = _more_drafter(report)
    return [_finding("target_waits_on_slots", f"the target waits {wait:.0%} of its time for a transfer slot "
                                              f"(target: {target['window']})",
                     "; ".join(f"{role}: {r['window']}, {r['wall_seconds']:.0f} s" for role, r in v["roles"].items())
                     + ": " + "; ".join(v["evidence"]), nxt, flags)]


STALL_INTERVALS = 3            # a rank's last intervals with no finished span: a stall


def _stalls(report: dict) -> list:
    stalled = [r for r in report["ranks"]["ranks"] if r["stalled_intervals"] >= STALL_INTERVALS]
    if not stalled:
        return []
    return [_finding("stalled", "no span finished on " + ", ".join(f"rank {r['rank']} ({r['role']})" for r in stalled)
                     + " at the end of the log",
                     "; ".join(f"rank {r['rank']}: its last {r['stalled_intervals']} intervals "
                               f"({r['stalled_seconds']:.0f} s) at step {r['steps']}" for r in stalled),
                     "while it stalls, dflash-profile snapshot --run-dir shows the span each thread holds open and "
                     "its stack" + ("" if _loop(report) else
                                    "; a first call that compiles shows as drafter.compile or triton.autotune"))]


def _straggler(report: dict) -> list:
    s = report["ranks"]["straggler"]
    if not s:
        return []
    where = (f"; its {s['span']} costs {s['span_seconds_per_token'] * 1e6:.1f} us/token vs "
             f"{s['peers_span_seconds_per_token'] * 1e6:.1f} us/token on its peers" if s.get("span") else "")
    return [_finding("straggler",
                     f"rank {s['rank']} ({s['role']}) is {1 - s['capacity_ratio']:.0%} slower than its peers",
                     f"capacity (tokens/s over the work share, both over its {s['window']}) "
                     f"{s['capacity_tokens_per_s']:.4g} tokens/s vs the peers' median "
                     f"{s['peers_median_tokens_per_s']:.4g}{where}",
                     "compare its GPU's clocks and throttle reasons, then swap its GPU with a peer's "
                     "(CUDA_VISIBLE_DEVICES) to tell the device from the rank's work")]


def _headroom(report: dict) -> list:
    out = []
    for g in report["memory"]["gpus"]:
        low = g["low_point"]
        if low["headroom_ratio"] >= LOW_HEADROOM_SHARE:
            continue
        when = f" at +{low['seconds_since_start']:.0f} s" if low["seconds_since_start"] is not None else ""
        nxt, flags = _batch_next(report, "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                                 "lower the batch size, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        out.append(_finding(
            "low_headroom", f"gpu {g['gpu']} fell to {low['headroom_ratio']:.1%} headroom during "
            f"{low['dominant_span']} (the interval's dominant span)",
            f"the whole run's low point over {g['intervals']} interval records: {low['headroom_bytes'] / GIB:.2f} GiB free "
            f"of {g['total_bytes'] / GIB:.1f} GiB{when}, rank {low['rank']} interval {low['interval']} step "
            f"{low['step']}", nxt, flags))
    for g in report["memory"]["gpus"]:
        for reason, n in g.get("throttle_intervals", {}).items():
            if reason not in ("gpu_idle", "applications_clocks_setting"):
                out.append(_finding("throttled", f"gpu {g['gpu']} reported clock reason {reason} in {n} intervals",
                                    f"NVML throttle_reasons in {n} of the whole run's {g['intervals']} interval records",
                                    "check cooling and power caps (nvidia-smi -q -d PERFORMANCE)"))
    return out


_NEXT_FOR_EVENT = {
    "thread_crash": "read the traceback in the event, fix, and rerun to that step",
    "hang": "take dflash-profile snapshot --run-dir while it stalls and read which span each thread holds",
    "bad_records": "fix or drop the data lines the event names (its path and count)",
    "run_failed": "read the rank's stderr and its last event; rerun with the failing step's DFLASH_FAULT to reproduce",
    "no_run_end": "the rank died without closing its log: check the host's OOM killer (dmesg) and the launcher's "
                  "output",
    "bad_lines": "a truncated last line is a crash's signature: see run_failed / no_run_end",
}


_LOOP_NEXT_FOR_EVENT = {
    "nonfinite": "check the tensors of the spans before it with profiler.check_finite(span, {name: tensor}) and rerun "
                 "to that step: the first span that produced a NaN/Inf is named",
    "signal": "nothing to fix if the stop was intended",
    "run_failed": "read the process's stderr and its last event",
}


def _event_next(report: dict, kind: str, first: dict) -> tuple[str, list]:
    """The next experiment for an event kind, with the flags it names (none for a loop of its own)."""
    if _loop(report) and kind in _LOOP_NEXT_FOR_EVENT:
        return _LOOP_NEXT_FOR_EVENT[kind], []
    if kind == "nonfinite":
        step = first.get("step")
        to = ["--max-steps", str(step)] if isinstance(step, int) and step >= 1 else []
        flags = ["--max-in-flight", "1", *to]
        return (f"rerun with {' '.join(flags)}, then with DFLASH_SPLIT_FC_LAYERS toggled: a NaN that goes away is a "
                "race between streams or a freed buffer, one that stays is the span's math", flags)
    if kind == "oom":
        nxt, flags = _batch_next(report, "lower the tokens per batch")
        return nxt + ", and read the OOM record's active spans and headroom history", flags
    if kind == "signal":
        return (f"nothing to fix if the stop was intended: continue it with --resume --run-dir {report['run_dir']}",
                ["--resume", "--run-dir", report["run_dir"]])
    return _NEXT_FOR_EVENT.get(kind, "read the event record"), []


def _where(example: dict) -> str:
    keys = ("rank", "span", "step", "last_step", "status", "signal", "reason", "path", "count", "lines", "message",
            "error")
    return ", ".join(f"{k} {example[k]}" for k in keys if example.get(k) is not None)


def _events(report: dict) -> list:
    ev = report["events"]
    out = []
    for kind in ev["problems"]:
        k = ev["kinds"][kind]
        first = k["examples"][0] if k["examples"] else {}
        out.append(_finding(kind, f"{k['count']} {kind} on rank{'s' if len(k['ranks']) > 1 else ''} "
                                  f"{', '.join(map(str, k['ranks']))} over the whole run", f"first: {_where(first)}",
                            *_event_next(report, kind, first)))
    return out


def _split(report: dict) -> list:
    s = report["split"]
    best, now = s.get("best"), s.get("current")
    if not best or not now or (best["target_gpus"], best["drafter_gpus"]) == (now["target_gpus"], now["drafter_gpus"]):
        return []
    gain = best["predicted_tokens_per_s"] / now["predicted_tokens_per_s"] - 1 if now["predicted_tokens_per_s"] else None
    if gain is None or gain < SPLIT_GAIN:
        return []
    flags = ["--target-gpus", str(best["target_gpus"]), "--drafter-gpus", str(best["drafter_gpus"])]
    return [_finding("split", f"a {best['target_gpus']}:{best['drafter_gpus']} split of {s['n_gpus']} GPUs is "
                              f"predicted {gain:.0%} faster than this run's {now['target_gpus']}:{now['drafter_gpus']}",
                     f"capacity per GPU (steady_tokens_per_s over the busy share of each rank's window) target "
                     f"{s['roles']['target']['capacity_tokens_per_s_per_gpu']:.4g}, drafter "
                     f"{s['roles']['drafter']['capacity_tokens_per_s_per_gpu']:.4g} tokens/s; predicted "
                     f"{best['predicted_tokens_per_s']:.4g} vs {now['predicted_tokens_per_s']:.4g} tokens/s",
                     f"rerun with {' '.join(flags)}" + ("" if s.get("n_gpus_from") == "the run"
                                                        else f" on {s['n_gpus']} GPUs"), flags)]


def _profiler_cost(report: dict) -> list:
    costly = [r for r in report["ranks"]["ranks"] if (r.get("profiler_share") or 0.0) > PROFILER_SHARE_HIGH]
    if not costly:
        return []
    if _loop(report):
        return [_finding("profiler_cost", f"the profiler's own threads cost {_costly(costly)}", _PROFILER_COST_EVIDENCE,
                         "raise ProfilerConfig(interval_s=...), keep only the sinks someone reads in "
                         "exporters.build(...), and see the interval records' threads_cpu_seconds for the thread "
                         "that costs it")]
    interval = (report.get("config") or {}).get("profile_interval")
    known = isinstance(interval, (int, float)) and interval > 0
    longer = f"{2 * interval:g}" if known else "120"
    flags = ["--profile-interval", longer, "--metrics-port", "0", "--stack-samples-per-interval", "0"]
    now = f" (now {interval:g} s)" if known else ""
    return [_finding("profiler_cost", f"the profiler's own threads cost {_costly(costly)}", _PROFILER_COST_EVIDENCE,
                     f"raise --profile-interval{now} to {longer}, drop exporters nobody reads (--metrics-port 0, no "
                     "OTEL_EXPORTER_OTLP_ENDPOINT, --stack-samples-per-interval 0), and see the interval "
                     "records' threads_cpu_seconds for the thread that costs it", flags)]


_PROFILER_COST_EVIDENCE = ("CPU seconds of the collector, exporter, NVML, stack and control threads and the "
                           "exporters' over the window's wall time (interval records' profiler_share); under the GIL "
                           "the training thread waits for much of it")


def _costly(rows: list) -> str:
    return ", ".join(f"rank {r['rank']} ({r['role']}) {r['profiler_share']:.1%} of its wall time "
                     f"({r.get('profiler_window', r['window'])})" for r in rows)


# The rules, problems first: each reads the assembled report and returns its findings.
RULES = (_events, _stalls, _headroom, _allocator, _straggler, _waits, _split, _launch_bound, _bandwidth,
         _profiler_cost)


def findings(report: dict) -> list:
    """Every finding of an assembled report (report.hotspots), in RULES order."""
    return [f for rule in RULES for f in rule(report)]
