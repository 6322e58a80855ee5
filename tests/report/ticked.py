"""A simulated run as the README's main job writes it (`--profile-interval 60`, 5 s ticks, ~80 s of training):
two intervals (warm-up, then final) and the cumulative `tick` records (docs/RUNLOG.md) of the same spans and the
drafter's loss, made from one timeline of whole spans per rank, so the intervals, ticks, run_end and throughput
events agree."""
from __future__ import annotations

import random

from tests.report.test_check import PHASES, entry, run_end, throughput_files

T0 = 2_000_000.0
TOKENS_PER_STEP = 512
WARM_END_S = 8.0     # the drafter compiles for 6 s, then two warm-up steps


def _timeline(fwd_s: float, length_s: float, seed: int, ckpt_s: float, recompile_s: float = 0.0) -> dict:
    """{rank: [(name, start_s, end_s)], "steps": [step end_s]}: the drafter (rank 0) compiles, then steps (recv,
    fwd_bwd jittered +-5%, optim) with a `ckpt_s` checkpoint at 40 s, and with `recompile_s` a compile of that
    long at the first step of every 2.5 s (a drafter that recompiles all along: new shapes); the target (rank 1)
    steps alongside, waiting on a transfer slot for what the drafter's step takes beyond its own work
    (drafter-bound)."""
    rng = random.Random(seed)
    drafter, target, steps = [("drafter.compile", 0.0, 6.0)], [], []
    t, compiled = 6.0, 6.0
    while True:
        if 40.0 <= t < 40.0 + fwd_s + 0.025:
            drafter.append(("ckpt.save", t, t + ckpt_s))
            t += ckpt_s
        if recompile_s and t >= compiled + 2.5 and t + recompile_s < length_s:
            drafter.append(("drafter.compile", t, t + recompile_s))
            target.append(("transfer.wait_slot", t, t + recompile_s))
            t, compiled = t + recompile_s, t
        f = fwd_s * (1.0 + rng.uniform(-0.05, 0.05))
        if t + 0.005 + f + 0.02 > length_s:
            break
        drafter += [("drafter.recv", t, t + 0.005), ("drafter.fwd_bwd", t + 0.005, t + 0.005 + f),
                    ("drafter.optim", t + 0.005 + f, t + 0.025 + f)]
        target += [("target.fwd", t, t + 0.1), ("transfer.send", t + 0.1, t + 0.11),
                   ("transfer.wait_slot", t + 0.11, t + 0.025 + f)]
        t += 0.025 + f
        steps.append(t)
    return {0: drafter, 1: target, "steps": steps}


def _tick(rank: int, role: str, index: int, t: float, spans: list, steps: list, **marks) -> dict:
    cum: dict = {}
    for name, start, end in spans:
        if start < t:
            c = cum.setdefault(name, {"count": 0, "cpu_seconds": 0.0, "self_seconds": 0.0})
            c["count"] += end <= t
            c["cpu_seconds"] += min(end, t) - start
            c["self_seconds"] += min(end, t) - start
    done = sum(1 for s in steps if s <= t)
    losses = [loss(k) for k in range(done)] if role == "drafter" else []
    metrics = {"loss": {"sum": sum(losses), "count": len(losses)}} if losses else {}
    return {"type": "tick", "time_unix": T0 + t, "rank": rank, "role": role, "index": index, "t_s": t,
            "step": done or None, "counters": {"tokens": done * TOKENS_PER_STEP, "steps": done}, "spans": cum,
            "metrics": metrics, **({"warmup": True} if t < WARM_END_S else {}), **marks}


def loss(step: int) -> float:
    """The drafter's simulated loss at a step (0-based): falling as training goes."""
    return 10.0 / (1.0 + 0.05 * step)


def _interval(rank: int, role: str, index: int, a: float, b: float, spans: list, steps: list, **marks) -> dict:
    thread = f"{role}.main"
    entries = {}
    for name in sorted({n for n, s, e in spans if s < b and e > a}):
        mine = [(s, e) for n, s, e in spans if n == name and s < b and e > a]
        whole = [e - s for s, e in mine if a < e <= b]
        entries[name] = entry(whole, thread, total=sum(min(e, b) - max(s, a) for s, e in mine))
        entries[name]["share"] = entries[name]["cpu"]["total_seconds"] / (b - a)
    tokens = sum(1 for s in steps if a < s <= b) * TOKENS_PER_STEP
    losses = [loss(k) for k, s in enumerate(steps) if a < s <= b] if role == "drafter" else []
    if losses:
        marks["metrics"] = {"loss": {"last": losses[-1], "mean": sum(losses) / len(losses)}}
    return {"type": "interval", "rank": rank, "role": role, "index": index, "start_s": a, "end_s": b,
            "step": sum(1 for s in steps if s <= b), "time_unix": T0 + b, "duration_seconds": b - a, "spans": entries,
            "counters": {"tokens": {"total": tokens, "per_second": tokens / (b - a)}}, **marks}


def ticked_run(fwd_s: float = 0.2, seed: int = 1, length_s: float = 80.0, interval_s: float = 60.0,
               tick_s: float | None = 5.0, ckpt_s: float = 1.5, recompile_s: float = 0.0) -> dict:
    """{"logs", "files"} as tests.report.test_check.write takes: each rank's run_start, its intervals (the first
    warm-up, the last final), its ticks every tick_s (none when tick_s is None: a log written before ticks),
    its throughput event and run_end."""
    tl = _timeline(fwd_s, length_s, seed, ckpt_s, recompile_s)
    steps = tl["steps"]
    logs = {}
    for rank, role in ((0, "drafter"), (1, "target")):
        spans = tl[rank]
        start = {"type": "run_start", "rank": rank, "role": role, "schema": 1, "run_id": "ticked", "hostname": "h",
                 "time_unix": T0, "interval_s": interval_s, "warmup_steps": 2, "phase_spans": list(PHASES)}
        edges = [0.0, *[k * interval_s for k in range(1, int(length_s // interval_s) + 1) if k * interval_s < length_s],
                 length_s]
        intervals = [_interval(rank, role, k, a, b, spans, steps, **({"warmup": True} if a < WARM_END_S else {}),
                               **({"final": True} if b == length_s else {}))
                     for k, (a, b) in enumerate(zip(edges, edges[1:]))]
        instants = sorted({*(k * tick_s for k in range(int(length_s // tick_s) + 1)), length_s}) if tick_s else []
        ticks = [_tick(rank, role, k, t, spans, steps, **({"final": True} if t == length_s else {}))
                 for k, t in enumerate(instants)]
        steady = [s for s in steps if s > WARM_END_S]
        phases = {"ckpt.save": ckpt_s if role == "drafter" else 0.0}
        if recompile_s and role == "drafter":   # the meter leaves compile time out of its window
            phases["drafter.compile"] = sum(e - b for n, b, e in spans if n == "drafter.compile" and b >= WARM_END_S)
        seconds = length_s - WARM_END_S - (phases.get("drafter.compile") or 0.0)
        rate = len(steady) * TOKENS_PER_STEP / seconds
        event = {"type": "event", "kind": "throughput", "rank": rank, "role": role, "time_unix": T0 + length_s,
                 "window": "steady state", "steady_tokens_per_s": rate, "steady_tokens": rate * seconds,
                 "steady_seconds": seconds, "steady_steps": len(steady), "phases_seconds": phases}
        # as the writer: a tick at each interval's close, in time order with them
        records = sorted([*intervals, *ticks], key=lambda r: (r["time_unix"], r["type"] == "interval"))
        logs[rank] = [start, *records, event, run_end(rank, role, intervals, len(steps))]
    return {"logs": logs, "files": throughput_files(logs)}
