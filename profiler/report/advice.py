"""Answers from the measured rates and peaks: the run's topology (its devices, and what the trainer accepts
on them), the target:drafter GPU split that balances the pipeline (only for two GPUs or more), and the
largest tokens per batch that keeps 5% memory headroom. Records in, answers out.

Split: a rank's capacity is its steady_tokens_per_s over its busy share (what it would reach never waiting).
Drafter d is fed by targets t with t mod D == d and the drafters step in lock-step, so every drafter goes
at the pace of the one with floor(T/D) producers:
    tokens/s(T, D) = D * min(floor(T/D) * target capacity, drafter capacity),  1 <= D <= T.
Memory margin: per GPU, the bytes that come and go with a batch are each allocator's peak reserved minus
its lowest allocated; the rest of the NVML peak used is fixed. Per-batch bytes grow linearly with tokens
per batch, or with their square under dense attention:
    max tokens per batch = mean tokens per batch * ((0.95 * total - fixed) / per_batch) ** (1 / exponent).
"""
from __future__ import annotations

import statistics

from profiler.schema import views
from profiler.report.analysis import rank_table
from profiler.report.runs import Run, counter_total, gpu_key
from profiler.report.runs import gpus as nvml_gpus
from profiler.schema.windows import allocator_bytes, gpu_peak_bytes, measured_memory, span_entries

HEADROOM_SHARE = 0.05
LOOP_ONLY = "a loop of its own: the split and the batch margin are for dflash-train's target and drafter ranks"


def _predicted(t: int, d: int, cap_t: float, cap_d: float) -> float:
    return d * min((t // d) * cap_t, cap_d)


def role_capacity(ranks: list) -> dict:
    """{role: {"capacity_tokens_per_s_per_gpu", "ranks", "tokens_per_s", "busy_share_mean", "windows"}} from
    rank_table rows: a rank's capacity is its steady_tokens_per_s over the busy share of its window."""
    out = {}
    for role in sorted({r["role"] for r in ranks}):
        rows = [r for r in ranks if r["role"] == role]
        caps = [r["steady_tokens_per_s"] / r["busy_share"] for r in rows
                if r["steady_tokens_per_s"] and r["busy_share"]]
        busy = [r["busy_share"] for r in rows if r["busy_share"] is not None]
        out[role] = {"ranks": len(rows), "tokens_per_s": sum(r["steady_tokens_per_s"] or 0.0 for r in rows),
                     "busy_share_mean": statistics.fmean(busy) if busy else None,
                     "windows": sorted({r["window"] for r in rows}),
                     "capacity_tokens_per_s_per_gpu": statistics.fmean(caps) if caps else None}
    return out


def _rank_device(log) -> tuple[str | None, str | None]:
    """(kind, GPU key) of one rank from its run_start's `device` ("cuda:1", "cpu"), else its NVML entries' GPU."""
    device = (views.run_start(log.run_starts[-1]).device or "") if log.run_starts else ""
    kind = device.split(":")[0] or None
    if kind == "cuda":
        return "cuda", f"{log.hostname or '?'}:{device.partition(':')[2] or '?'}"
    if kind is not None:
        return kind, None
    nvml = next((g for rec in log.intervals for g in nvml_gpus(rec)), None)
    return ("cuda", gpu_key(log, nvml)) if nvml is not None else (None, None)


def _effective_transfer(flag: str | None, device: str | None, distinct: bool, host_copies: bool) -> str | None:
    """The path batches took, by dflash/worker.py's rule (read, not imported): NCCL when asked, or on auto when
    every rank has its own GPU and no target span is a d2h_copy; else the host."""
    if device != "cuda":
        return "host" if device else None
    if flag in ("nccl", "host"):
        return flag
    return "host" if host_copies or not distinct else "nccl"


def run_topology(run: Run) -> dict:
    """The run's devices, and what the trainer accepts on them (dflash/preflight.py's rule, read, not imported:
    --transfer nccl needs CUDA and one GPU per rank on every host)."""
    hosts: dict = {}
    kinds = set()
    for log in run.ranks.values():
        kind, gpu = _rank_device(log)
        kinds.add(kind)
        h = hosts.setdefault(log.hostname or "?", {"host": log.hostname, "ranks": 0, "gpus": set()})
        h["ranks"] += 1
        if gpu is not None:
            h["gpus"].add(gpu)
    device = "cuda" if "cuda" in kinds else next((k for k in kinds if k), None)
    rows = [{**h, "gpus": len(h["gpus"])} for h in hosts.values()]
    n_gpus, world = sum(h["gpus"] for h in rows), sum(h["ranks"] for h in rows)
    short = [h for h in rows if h["gpus"] < h["ranks"]]
    refused = ("this run is on the CPU" if device == "cpu" else "the records do not say the run had GPUs"
               if device is None else "; ".join(f"{h['ranks']} ranks on {h['gpus']} GPU(s) of host {h['host']}"
                                                 for h in short) or None)
    host_copies = any("d2h_copy" in span_entries(rec) for log in run.by_role().get("target", [])
                      for rec in log.intervals)
    flag = run.config.get("transfer")
    roles = run.by_role()
    return {"device": device, "gpus": n_gpus, "ranks": world, "hosts": rows,
            "target_ranks": len(roles.get("target", [])), "drafter_ranks": len(roles.get("drafter", [])),
            "ranks_share_gpus": device == "cuda" and bool(short), "transfer_flag": flag,
            "transfer": _effective_transfer(flag, device, all(h["gpus"] >= world for h in rows), host_copies),
            "nccl_allowed": refused is None, "nccl_refused": refused}


def _too_few_gpus(topo: dict) -> str:
    """Why a run without --gpus N has no split (fewer than two GPUs of its own)."""
    ask = "dflash-report hotspots --gpus N gives the split of N GPUs"
    if topo["device"] == "cpu":
        return f"a CPU run has no GPUs to split; {ask}"
    if topo["device"] is None:
        return f"the records do not say which GPUs the ranks used; {ask}"
    return (f"the run's {topo['ranks']} ranks share {topo['gpus']} GPU: a split needs at least 2 GPUs; {ask}"
            if topo["gpus"] == 1 else f"a split needs at least 2 GPUs, the run had {topo['gpus']}; {ask}")


def split(run: Run, n_gpus: int | None = None, ranks: list | None = None) -> dict:
    """The best target:drafter split of n_gpus (default: the run's GPUs), every split's prediction, and the
    run's own predicted and measured; `reason` below 2 GPUs. `ranks`: rank_table(run)'s rows, if computed."""
    topo = run_topology(run)
    caps = role_capacity(ranks if ranks is not None else rank_table(run)["ranks"])
    t_now, d_now = (caps.get("target") or {}).get("ranks", 0), (caps.get("drafter") or {}).get("ranks", 0)
    n = n_gpus or topo["gpus"]
    cap_t = (caps.get("target") or {}).get("capacity_tokens_per_s_per_gpu")
    cap_d = (caps.get("drafter") or {}).get("capacity_tokens_per_s_per_gpu")
    out = {"n_gpus": n, "n_gpus_from": "--gpus" if n_gpus else "the run", "topology": topo, "roles": caps,
           "best": None, "splits": [], "current": None, "reason": None,
           "model": "tokens/s = D * min(floor(T/D) * target capacity, drafter capacity), 1 <= D <= T"}
    if not run.pipeline:
        out["reason"] = LOOP_ONLY
        return out
    if n < 2:
        out["reason"] = _too_few_gpus(topo) if not n_gpus else f"a split needs at least 2 GPUs, got --gpus {n}"
        return out
    if not cap_t or not cap_d:
        out["reason"] = ("needs the steady-state tokens/s (throughput events) and the busy share of both a target "
                         "and a drafter rank")
        return out
    out["targets_per_drafter_to_balance"] = cap_d / cap_t
    out["splits"] = [{"target_gpus": t, "drafter_gpus": n - t,
                      "predicted_tokens_per_s": _predicted(t, n - t, cap_t, cap_d)} for t in range(1, n) if n - t <= t]
    out["best"] = max(out["splits"], key=lambda s: (s["predicted_tokens_per_s"], -s["target_gpus"]))
    if t_now and d_now:
        out["current"] = {"target_gpus": t_now, "drafter_gpus": d_now,
                          "predicted_tokens_per_s": _predicted(t_now, d_now, cap_t, cap_d),
                          "measured_tokens_per_s": caps["drafter"]["tokens_per_s"]}
    return out


def _rank_memory(log) -> dict | None:
    """One rank's GPU, NVML peak used and total, and per-batch bytes (allocator peak reserved minus lowest
    allocated); None without NVML and allocator stats."""
    gpu = used_peak = total = alloc_floor = alloc_peak = None
    for rec in log.intervals:
        measured = measured_memory(rec)
        if measured is None:
            continue
        for g in measured[0]:
            used, gpu_total = gpu_peak_bytes(g)
            if used is not None and gpu_total:
                used_peak, total = max(used_peak or 0, used), gpu_total
                gpu = gpu_key(log, g)
        alloc = allocator_bytes(measured[1])   # (allocated, peak reserved, peak allocated), or None: not read
        if alloc is None:
            continue
        allocated, peak = alloc[0], alloc[1] or alloc[2]
        if allocated is not None and peak is not None:
            alloc_floor = allocated if alloc_floor is None else min(alloc_floor, allocated)
            alloc_peak = max(alloc_peak or 0, peak)
    if used_peak is None or alloc_peak is None:
        return None
    return {"gpu": gpu, "rank": log.rank, "role": log.role, "total_bytes": total, "used_bytes_peak": used_peak,
            "per_batch_bytes": alloc_peak - alloc_floor}


def _gpu_memory(models: list) -> list:
    """Per GPU: the ranks on it, its NVML peak used, the sum of their per-batch bytes, and the rest: fixed."""
    gpus: dict = {}
    for m in models:
        g = gpus.setdefault(m["gpu"], {"gpu": m["gpu"], "ranks": [], "roles": [], "total_bytes": m["total_bytes"],
                                       "used_bytes_peak": 0, "per_batch_bytes": 0})
        g["ranks"].append(m["rank"])
        g["roles"] = sorted(set(g["roles"]) | {m["role"]})
        g["used_bytes_peak"] = max(g["used_bytes_peak"], m["used_bytes_peak"])
        g["per_batch_bytes"] += m["per_batch_bytes"]
    for g in gpus.values():
        g["fixed_bytes"] = g["used_bytes_peak"] - g["per_batch_bytes"]
    return list(gpus.values())


def growth(config: dict) -> tuple[int, str]:
    """How per-batch bytes grow with tokens per batch: (exponent, why)."""
    if config.get("attn_backend") == "dense":
        return 2, "quadratic: dense attention's scores and mask grow with the square of the tokens per batch"
    return 1, "linear: activations grow with the tokens per batch"


def mean_tokens_per_batch(run: Run) -> float | None:
    """Tokens the drafters trained on per step (short data fills a batch less; memory follows what it holds)."""
    intervals = [r for log in run.by_role().get("drafter", []) for r in log.intervals]
    tokens, steps = counter_total(intervals, "tokens"), counter_total(intervals, "steps")
    return tokens / steps if tokens and steps else None


def memory_margin(run: Run) -> dict:
    """{"max_tokens_per_batch": the largest keeping HEADROOM_SHARE free on every GPU, "gpus", "limited_by",
    "reason"}; ranks that share a GPU add their per-batch bytes."""
    headroom_share = HEADROOM_SHARE
    mean = mean_tokens_per_batch(run)
    tpb = mean or run.config.get("tokens_per_batch")
    exponent, why = growth(run.config)
    out = {"headroom_share": headroom_share, "tokens_per_batch": run.config.get("tokens_per_batch"),
           "mean_tokens_per_batch": mean, "max_tokens_per_batch": None, "growth_exponent": exponent,
           "growth": why, "limited_by": None, "gpus": [], "reason": None}
    if not run.pipeline:
        out["reason"] = LOOP_ONLY
        return out
    models = [m for log in run.ranks.values() if (m := _rank_memory(log))]
    if not models:
        out["reason"] = "no GPU memory measured (needs NVML and allocator stats)"
        return out
    if not tpb:
        out["reason"] = "neither token and step counters nor run_start.config's tokens_per_batch"
        return out
    out["gpus"] = _gpu_memory(models)
    for g in out["gpus"]:
        limit = (1.0 - headroom_share) * g["total_bytes"]
        room = max(0.0, limit - g["fixed_bytes"])
        g["max_tokens_per_batch"] = (int(tpb * (room / g["per_batch_bytes"]) ** (1.0 / exponent))
                                     if g["per_batch_bytes"] > 0 else None)
    fitted = [g for g in out["gpus"] if g["max_tokens_per_batch"] is not None]
    if not fitted:
        out["reason"] = "no rank's allocated bytes varied between intervals: nothing to extrapolate from"
        return out
    worst = min(fitted, key=lambda g: g["max_tokens_per_batch"])
    out["max_tokens_per_batch"] = max(0, worst["max_tokens_per_batch"])
    out["limited_by"] = {"gpu": worst["gpu"], "ranks": worst["ranks"], "roles": worst["roles"]}
    return out
