"""Findings: the few things in a report worth acting on, each with its evidence and the next experiment."""
from __future__ import annotations

from report.analysis import WAIT_BOUND_SHARE

FLOOR_RATIO_LOW = 0.25         # a span moving its bytes at under a quarter of the floor's bandwidth
FLOOR_LOSS_SHARE = 0.01        # ... and losing at least this share of its role's time to it
RESERVED_GROWTH = 0.10         # allocator reserved memory growing by more than this over the run
LOW_HEADROOM_SHARE = 0.05
SPLIT_GAIN = 0.10              # a better split must predict at least this much more throughput
PROFILER_SHARE_HIGH = 0.02     # the profiler's threads using over 2% of a rank's wall time in CPU
GIB = 1024 ** 3

_NEXT_FOR_COPY = {
    "transfer.send": "try the other transfer path (--transfer nccl or --transfer host) and time the bare link "
                     "with bench/nccl_p2p.py",
    "target.pack_hidden": "try --split-fc-layers (ship the layers, concatenate on the drafter)",
    "d2h_copy": "check the host buffer is pinned and the copy non_blocking; compare with bench/nccl_p2p.py",
    "h2d_copy": "check the host buffer is pinned and the copy non_blocking; compare with bench/nccl_p2p.py",
}


def _finding(kind: str, summary: str, evidence: str, next_: str) -> dict:
    return {"kind": kind, "summary": summary, "evidence": evidence, "next": next_}


def _bandwidth(report: dict) -> list:
    walls = {role: r["wall_seconds"] for role, r in report["spans"]["roles"].items()}
    out = []
    for b in report["bandwidth"]:
        wall = walls.get(b["role"]) or 0.0
        lost = b["seconds_over_floor"]
        if b["floor_ratio"] is None or b["floor_ratio"] >= FLOOR_RATIO_LOW or not wall \
                or lost < FLOOR_LOSS_SHARE * wall:
            continue
        out.append(_finding(
            "below_floor", f"{b['span']} ({b['role']}) moves its bytes at {b['floor_ratio'] * 100:.2g}% of the "
                           f"{b['floor']} floor",
            f"{b['bytes'] / 1e9:.3g} GB in {b['seconds']:.3g} s = {b['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s vs "
            f"{b['floor_bytes_per_s'] / 1e9:.3g} GB/s measured at start; {lost:.3g} s over the floor "
            f"({lost / wall:.1%} of the {b['role']}'s time)",
            _NEXT_FOR_COPY.get(b["span"], "time the copy alone at this size against the floor")))
    return out


def _ranks_text(items: list) -> str:
    return ", ".join(f"rank {a['rank']} ({a['role']})" for a in items)


def _allocator(report: dict) -> list:
    """One finding for every rank whose allocator retried, one for every rank whose reserved memory grew."""
    allocs = report["memory"]["allocator"]
    retried = [a for a in allocs if (a["alloc_retries_last"] or 0) > 0]
    grew = [a for a in allocs if a["reserved_bytes_first"] and a["reserved_bytes_last"]
            and a["reserved_bytes_last"] > (1 + RESERVED_GROWTH) * a["reserved_bytes_first"]
            and a["reserved_bytes_last"] >= max(x or 0 for x in a["reserved_series_bytes"])]
    out = []
    if retried:
        out.append(_finding(
            "alloc_retries", f"the allocator retried cudaMalloc on {len(retried)} rank(s)",
            "; ".join(f"rank {a['rank']} ({a['role']}): num_alloc_retries {a['alloc_retries_first'] or 0} at the "
                      f"first interval, {a['alloc_retries_last']} at the last" for a in retried)
            + ": it freed its cache to fit",
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or lower --tokens-per-batch toward the "
            "memory margin"))
    if grew:
        out.append(_finding(
            "reserved_growing", f"reserved memory grew over {RESERVED_GROWTH:.0%} and was at its high at the end on "
                                f"{_ranks_text(grew)}",
            "; ".join(f"rank {a['rank']}: {a['reserved_bytes_first'] / GIB:.2f} -> "
                      f"{a['reserved_bytes_last'] / GIB:.2f} GiB" for a in grew),
            "look for tensors kept across steps (buffers held for in-flight transfers, lists of losses); "
            "take an allocator history snapshot over a few intervals"))
    return out


def _waits(report: dict) -> list:
    v = report["verdict"]
    target = v["roles"].get("target") or {}
    wait = target.get("wait_share")
    if wait is None or wait < WAIT_BOUND_SHARE:
        return []
    in_flight = report["config"].get("max_in_flight")
    if v["verdict"] == "transfer-bound":
        nxt = (f"raise --max-in-flight from {in_flight} to {2 * in_flight}" if in_flight
               else "raise --max-in-flight") + " and check transfer.send's bandwidth against its floor"
    else:
        best, now = report["split"].get("best"), report["split"].get("current")
        if best and now and (best["target_gpus"], best["drafter_gpus"]) != (now["target_gpus"], now["drafter_gpus"]):
            nxt = f"move GPUs to the drafters: the split advice says {best['target_gpus']}:{best['drafter_gpus']}"
        else:
            nxt = ("no split of this GPU count does better: make the drafter's step cheaper, or add a drafter GPU "
                   "(--gpus N shows the split for N GPUs)")
    return [_finding("target_waits_on_slots", f"the target waits {wait:.0%} of its time for a transfer slot",
                     "; ".join(v["evidence"]), nxt)]


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
                     "its stack; a first call that compiles shows as drafter.compile or triton.autotune")]


def _straggler(report: dict) -> list:
    s = report["ranks"]["straggler"]
    if not s:
        return []
    where = (f"; its {s['span']} costs {s['span_seconds_per_token'] * 1e6:.1f} us/token vs "
             f"{s['peers_span_seconds_per_token'] * 1e6:.1f} us/token on its peers" if s.get("span") else "")
    return [_finding("straggler",
                     f"rank {s['rank']} ({s['role']}) is {1 - s['capacity_ratio']:.0%} slower than its peers",
                     f"capacity {s['capacity_tokens_per_s']:.4g} tokens/s vs the peers' median "
                     f"{s['peers_median_tokens_per_s']:.4g}{where}",
                     "compare its GPU's clocks and throttle reasons, then swap its GPU with a peer's "
                     "(CUDA_VISIBLE_DEVICES) to tell the device from the rank's work")]


def _headroom(report: dict) -> list:
    out = []
    margin = report["memory_margin"].get("max_tokens_per_batch")
    for g in report["memory"]["gpus"]:
        low = g["low_point"]
        if low["headroom_ratio"] >= LOW_HEADROOM_SHARE:
            continue
        when = f" at +{low['seconds_since_start']:.0f} s" if low["seconds_since_start"] is not None else ""
        out.append(_finding(
            "low_headroom", f"gpu {g['gpu']} fell to {low['headroom_ratio']:.1%} headroom during "
            f"{low['dominant_span']} (the interval's dominant span)",
            f"{low['headroom_bytes'] / GIB:.2f} GiB free of {g['total_bytes'] / GIB:.1f} GiB{when}, rank "
            f"{low['rank']} interval {low['interval']} step {low['step']}",
            f"lower --tokens-per-batch to {margin} (the memory margin)" if margin
            else "lower --tokens-per-batch, or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    for g in report["memory"]["gpus"]:
        for reason, n in g.get("throttle_intervals", {}).items():
            if reason not in ("gpu_idle", "applications_clocks_setting"):
                out.append(_finding("throttled", f"gpu {g['gpu']} reported clock reason {reason} in {n} intervals",
                                    "NVML throttle_reasons in the interval records",
                                    "check cooling and power caps (nvidia-smi -q -d PERFORMANCE)"))
    return out


_NEXT_FOR_EVENT = {
    "nonfinite": "rerun to that step with --max-in-flight 1 and DFLASH_SPLIT_FC_LAYERS toggled: a NaN that goes "
                 "away is a race between streams or a freed buffer, one that stays is the span's math",
    "oom": "lower --tokens-per-batch to the memory margin, and read the OOM record's active spans and headroom history",
    "thread_crash": "read the traceback in the event, fix, and rerun to that step",
    "hang": "take dflash-profile snapshot --run-dir while it stalls and read which span each thread holds",
    "signal": "nothing to fix if the stop was intended: resume with --resume",
    "bad_records": "fix or drop the data lines the event names (--on-bad-record)",
    "run_failed": "read the rank's stderr and its last event; rerun with the failing step's DFLASH_FAULT to reproduce",
    "no_run_end": "the rank died without closing its log: check the host's OOM killer (dmesg) and the launcher's "
                  "output",
    "bad_lines": "a truncated last line is a crash's signature: see run_failed / no_run_end",
}


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
                                  f"{', '.join(map(str, k['ranks']))}", f"first: {_where(first)}",
                            _NEXT_FOR_EVENT.get(kind, "read the event record")))
    return out


def _split(report: dict) -> list:
    s = report["split"]
    best, now = s.get("best"), s.get("current")
    if not best or not now or (best["target_gpus"], best["drafter_gpus"]) == (now["target_gpus"], now["drafter_gpus"]):
        return []
    gain = best["predicted_tokens_per_s"] / now["predicted_tokens_per_s"] - 1 if now["predicted_tokens_per_s"] else None
    if gain is None or gain < SPLIT_GAIN:
        return []
    return [_finding("split", f"a {best['target_gpus']}:{best['drafter_gpus']} split is predicted {gain:.0%} faster "
                              f"than this run's {now['target_gpus']}:{now['drafter_gpus']}",
                     f"capacity per GPU: target {s['roles']['target']['capacity_tokens_per_s_per_gpu']:.4g}, drafter "
                     f"{s['roles']['drafter']['capacity_tokens_per_s_per_gpu']:.4g} tokens/s; predicted "
                     f"{best['predicted_tokens_per_s']:.4g} vs {now['predicted_tokens_per_s']:.4g} tokens/s",
                     f"rerun with --target-gpus {best['target_gpus']} --drafter-gpus {best['drafter_gpus']}")]


def _profiler_cost(report: dict) -> list:
    costly = [r for r in report["ranks"]["ranks"] if (r.get("profiler_share") or 0.0) > PROFILER_SHARE_HIGH]
    if not costly:
        return []
    interval = (report.get("config") or {}).get("profile_interval")
    now = f" (now {interval:g} s)" if isinstance(interval, (int, float)) else ""
    who = ", ".join(f"rank {r['rank']} ({r['role']}) {r['profiler_share']:.1%}" for r in costly)
    return [_finding("profiler_cost", f"the profiler's own threads cost {who} of the wall time",
                     "CPU seconds of the collector, exporter, NVML, stack and control threads and the exporters' "
                     "over the steady intervals' wall time (interval records' profiler_share); under the GIL the "
                     "training thread waits for much of it",
                     f"raise --profile-interval{now}, drop exporters nobody reads (--metrics-port 0, no "
                     "OTEL_EXPORTER_OTLP_ENDPOINT, --stack-samples-per-interval 0), and see the interval "
                     "records' threads_cpu_seconds for the thread that costs it")]


# The rules, problems first: each reads the assembled report and returns its findings.
RULES = (_events, _stalls, _headroom, _allocator, _straggler, _waits, _split, _bandwidth, _profiler_cost)


def findings(report: dict) -> list:
    """Every finding of an assembled report (report.hotspots), in RULES order."""
    return [f for rule in RULES for f in rule(report)]
