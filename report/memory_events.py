"""The report's analyses of memory (headroom low points, allocator trends), events (problems first) and
stacks (hot frames per thread): records in, answers out.
"""
from __future__ import annotations

from collections import Counter

from report.runs import Run, gpu_key

# Event kinds that mean something went wrong, shown first and with examples.
PROBLEM_KINDS = ("nonfinite", "oom", "thread_crash", "hang", "signal", "bad_records", "stop")
EXAMPLES_PER_KIND = 3
FRAMES_PER_THREAD = 5
_TEXT_LIMIT = 300


def _dominant_span(rec: dict) -> tuple[str | None, float | None]:
    """The span with the largest share of an interval: where the interval's time went, not an exact
    attribution of its memory peak (the sampler's peak has no span)."""
    spans = rec.get("spans") or {}
    if not spans:
        return None, None
    name = max(spans, key=lambda n: spans[n].get("share") or 0.0)
    return name, spans[name].get("share")


def _low_point(log, rec: dict, g: dict, t0: float | None) -> dict:
    name, share = _dominant_span(rec)
    t = rec.get("time_unix")
    return {"headroom_bytes": g["headroom_bytes"], "headroom_ratio": g["headroom_bytes"] / g["total_bytes"],
            "used_bytes_peak": g.get("used_bytes_peak"), "time_unix": t,
            "seconds_since_start": t - t0 if t is not None and t0 is not None else None,
            "rank": log.rank, "interval": rec.get("index"), "step": rec.get("step"),
            "dominant_span": name, "dominant_span_share": share}


def _allocator_trend(log) -> dict | None:
    allocs = [a for r in log.intervals if (a := (r.get("memory") or {}).get("allocator") or {}).get("available")]
    if not allocs:
        return None
    first, last = allocs[0], allocs[-1]
    return {"rank": log.rank, "role": log.role, "intervals": len(allocs),
            "alloc_retries_first": first.get("num_alloc_retries"), "alloc_retries_last": last.get("num_alloc_retries"),
            "ooms_last": last.get("num_ooms"),
            "reserved_bytes_first": first.get("reserved_bytes"), "reserved_bytes_last": last.get("reserved_bytes"),
            "reserved_bytes_peak": max((a.get("peak_reserved_bytes") or a.get("reserved_bytes") or 0) for a in allocs),
            "reserved_series_bytes": [a.get("reserved_bytes") for a in allocs]}


def _gpu_row(key: str, samples: list) -> dict:
    """One GPU from its (log, interval, gpu entry, run start time) samples: the low point is the first least
    headroom."""
    log, _, g, _ = samples[0]
    entries = [s[2] for s in samples]
    return {"gpu": key, "host": log.hostname, "index": g.get("index"), "name": g.get("name"),
            "total_bytes": g["total_bytes"], "ranks": sorted({s[0].rank for s in samples}), "intervals": len(samples),
            "low_point": _low_point(*min(samples, key=lambda s: s[2]["headroom_bytes"])),
            "used_bytes_peak": max([0] + [e.get("used_bytes_peak") or 0 for e in entries]),
            "throttle_intervals": dict(Counter(r for e in entries for r in e.get("throttle_reasons") or [])),
            "last_headroom_bytes": entries[-1]["headroom_bytes"]}


def headroom(run: Run) -> dict:
    """{"measured", "reason", "gpus": [per GPU (host:index): low point, last headroom, throttle intervals],
    "allocator": [per rank trend]}; headroom = total minus the interval's NVML peak used."""
    samples: dict = {}
    reasons = set()
    for log in run.ranks.values():
        t0 = next((s.get("time_unix") for s in log.run_starts), None)
        for rec in log.intervals:
            mem = rec.get("memory") or {}
            if not mem.get("available"):
                reasons.add(mem.get("reason") or "no memory record")
                continue
            for g in mem.get("gpus") or []:
                if g.get("headroom_bytes") is not None and g.get("total_bytes"):
                    samples.setdefault(gpu_key(log, g), []).append((log, rec, g, t0))
    gpus = [_gpu_row(key, s) for key, s in samples.items()]
    allocator = [t for log in run.ranks.values() if (t := _allocator_trend(log))]
    reason = None if gpus else "no GPU memory measured" + (f" ({'; '.join(sorted(reasons))})" if reasons else "")
    return {"measured": bool(gpus), "reason": reason, "gpus": gpus, "allocator": allocator}


def _example(rec: dict) -> dict:
    out = {k: v[:_TEXT_LIMIT] + "..." if isinstance(v, str) and len(v) > _TEXT_LIMIT else v
           for k, v in rec.items() if k not in ("type", "time_unix", "role")}
    return {**out, "time_unix": rec.get("time_unix")}


def events(run: Run) -> dict:
    """{"kinds": {kind: {"count", "ranks", "examples"}}, "problems": the kinds that mean trouble}, with
    unparsable lines as `bad_lines`, failed segments `run_failed`, logs without run_end `no_run_end`."""
    kinds: dict = {}

    def add(kind: str, rank: int, example: dict, count: int = 1) -> None:
        k = kinds.setdefault(kind, {"count": 0, "ranks": [], "examples": []})
        k["count"] += count
        k["ranks"] = sorted(set(k["ranks"]) | {rank})
        if len(k["examples"]) < EXAMPLES_PER_KIND:
            k["examples"].append(example)

    for log in run.ranks.values():
        for ev in log.events:
            add(str(ev.get("kind")), log.rank, _example(ev))
        if log.bad_lines:
            add("bad_lines", log.rank, {"rank": log.rank, "lines": log.bad_lines}, count=log.bad_lines)
        for end in log.run_ends:
            if end.get("status") not in (None, "ok"):
                add("run_failed", log.rank, {"rank": log.rank, "status": end.get("status"), "step": end.get("step")})
        if len(log.run_ends) < len(log.run_starts):
            add("no_run_end", log.rank, {"rank": log.rank, "last_step": max(
                (r.get("step") or 0 for r in log.intervals), default=None)})
    order = (*PROBLEM_KINDS, "run_failed", "no_run_end", "bad_lines")
    return {"kinds": kinds, "problems": [k for k in order if k in kinds]}


def _thread_acc(threads: dict, rank: int, t: dict) -> dict:
    key = (rank, t.get("name"))
    return threads.setdefault(key, {"rank": rank, "thread": t.get("name"), "native_id": t.get("native_id"),
                                    "stack_samples": 0, "frames": Counter(), "snapshots": 0, "stuck_snapshots": 0,
                                    "snapshot_frames": Counter(), "open_spans": []})


def hot_frames(run: Run) -> dict:
    """Per thread, hottest first: its stack samples' top frames, and its snapshots' innermost frames,
    stuck count and open spans."""
    threads: dict = {}
    for log in run.ranks.values():
        for rec in log.intervals:
            samples = rec.get("stack_samples") or {}
            for t in samples.get("threads") or []:
                acc = _thread_acc(threads, log.rank, t)
                acc["stack_samples"] += samples.get("samples") or 0
                for f in t.get("top_frames") or []:
                    acc["frames"][f.get("frame")] += f.get("count") or 0
        for snap in log.snapshots:
            for t in snap.get("threads") or []:
                acc = _thread_acc(threads, log.rank, t)
                acc["snapshots"] += 1
                acc["stuck_snapshots"] += bool(t.get("stuck"))
                if t.get("frames"):
                    acc["snapshot_frames"][t["frames"][0]] += 1
                acc["open_spans"] = t.get("open_spans") or acc["open_spans"]
    out = []
    for acc in threads.values():
        n = acc["stack_samples"]
        acc["top_frames"] = [{"frame": f, "count": c, "share": c / n if n else None}
                             for f, c in acc.pop("frames").most_common(FRAMES_PER_THREAD)]
        acc["snapshot_frames"] = [{"frame": f, "count": c}
                                  for f, c in acc["snapshot_frames"].most_common(FRAMES_PER_THREAD)]
        out.append(acc)
    out.sort(key=lambda a: (-sum(f["count"] for f in a["top_frames"]), -a["stuck_snapshots"], -a["snapshots"],
                            a["rank"]))
    reason = None if out else ("no stack samples or snapshots in the logs (run with --stack-samples-per-interval N, "
                               "or take one with dflash-profile snapshot)")
    return {"threads": out, "reason": reason}

