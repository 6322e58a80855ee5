"""Two answers from the measured rates and peaks: the target:drafter GPU split that balances the
pipeline, and the largest tokens per batch that keeps 5% memory headroom. Records in, answers out.

Split: a rank's capacity is its steady tokens/s over its busy share (what it would reach never waiting).
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

from report.analysis import rank_table
from report.runs import Run, counter_total, gpu_key

HEADROOM_SHARE = 0.05


def _predicted(t: int, d: int, cap_t: float, cap_d: float) -> float:
    return d * min((t // d) * cap_t, cap_d)


def role_capacity(ranks: list) -> dict:
    """{role: {"capacity_tokens_per_s_per_gpu", "ranks", "tokens_per_s"}} from rank_table rows."""
    out = {}
    for role in sorted({r["role"] for r in ranks}):
        rows = [r for r in ranks if r["role"] == role]
        caps = [r["tokens_per_s"] / r["busy_share"] for r in rows if r["tokens_per_s"] and r["busy_share"]]
        out[role] = {"ranks": len(rows), "tokens_per_s": sum(r["tokens_per_s"] or 0.0 for r in rows),
                     "busy_share_mean": statistics.fmean(r["busy_share"] for r in rows if r["busy_share"] is not None)
                     if any(r["busy_share"] is not None for r in rows) else None,
                     "capacity_tokens_per_s_per_gpu": statistics.fmean(caps) if caps else None}
    return out


def split(run: Run, n_gpus: int | None = None, ranks: list | None = None) -> dict:
    """The best target:drafter split of n_gpus (default: the run's), every split's prediction, and the
    run's own predicted and measured. `ranks`: rank_table(run)'s rows, when already computed."""
    caps = role_capacity(ranks if ranks is not None else rank_table(run)["ranks"])
    t_now, d_now = (caps.get("target") or {}).get("ranks", 0), (caps.get("drafter") or {}).get("ranks", 0)
    n = n_gpus or t_now + d_now
    cap_t = (caps.get("target") or {}).get("capacity_tokens_per_s_per_gpu")
    cap_d = (caps.get("drafter") or {}).get("capacity_tokens_per_s_per_gpu")
    out = {"n_gpus": n, "roles": caps, "best": None, "splits": [], "current": None, "reason": None,
           "model": "tokens/s = D * min(floor(T/D) * target capacity, drafter capacity), 1 <= D <= T"}
    if not cap_t or not cap_d:
        out["reason"] = "needs the steady tokens/s and busy share of both a target and a drafter rank"
        return out
    if n < 2:
        out["reason"] = f"a split needs at least 2 GPUs, got {n}"
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
    """One rank's GPU (host:index), NVML peak used and total, and per-batch bytes (allocator peak reserved
    minus lowest allocated); None without NVML and allocator stats."""
    gpu = used_peak = total = alloc_floor = alloc_peak = None
    for rec in log.intervals:
        mem = rec.get("memory") or {}
        if not mem.get("available"):
            continue
        for g in mem.get("gpus") or []:
            if g.get("used_bytes_peak") is not None and g.get("total_bytes"):
                used_peak, total = max(used_peak or 0, g["used_bytes_peak"]), g["total_bytes"]
                gpu = gpu_key(log, g)
        a = mem.get("allocator") or {}
        peak = a.get("peak_reserved_bytes") or a.get("peak_allocated_bytes")
        if a.get("available") and a.get("allocated_bytes") is not None and peak is not None:
            alloc_floor = a["allocated_bytes"] if alloc_floor is None else min(alloc_floor, a["allocated_bytes"])
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
    tokens = steps = 0.0
    for log in run.by_role().get("drafter", []):
        tokens += counter_total(log.intervals, "tokens")
        steps += counter_total(log.intervals, "steps")
    return tokens / steps if tokens and steps else None


def memory_margin(run: Run) -> dict:
    """{"max_tokens_per_batch": the largest keeping HEADROOM_SHARE free on every GPU, "gpus": each GPU's
    model, "limited_by", "reason" when it cannot be said}; ranks that share a GPU add their per-batch bytes."""
    headroom_share = HEADROOM_SHARE
    mean = mean_tokens_per_batch(run)
    tpb = mean or run.config.get("tokens_per_batch")
    exponent, why = growth(run.config)
    out = {"headroom_share": headroom_share, "tokens_per_batch": run.config.get("tokens_per_batch"),
           "mean_tokens_per_batch": mean, "max_tokens_per_batch": None, "growth_exponent": exponent,
           "growth": why, "limited_by": None, "gpus": [], "reason": None}
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
