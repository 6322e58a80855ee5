"""A long synthetic run log for the report's scaling tests: a target and a drafter rank of `intervals` CPU-timed
intervals each (a CPU run has no GPU times, so every span is read on the CPU clock over all its entries), in the
schema-1 shape of docs/RUNLOG.md, with a small detail window every interval. Written line by line, so a long log
costs the test its bytes on disk, not their objects in memory."""
from __future__ import annotations

import json
from pathlib import Path

T0 = 1_700_000_000.0
INTERVAL_S = 10.0
BOUNDS = [0.001, 0.01, 0.1, 1.0, 10.0]
SPANS = {"target": [("target.fwd", 0.05, "target.main"), ("transfer.wait_slot", 0.01, "target.main"),
                    ("transfer.send", 0.02, "target.sender")],
         "drafter": [("drafter.recv", 0.01, "drafter.main"), ("drafter.fwd_bwd", 0.06, "drafter.main"),
                     ("drafter.optim", 0.005, "drafter.main")]}
STEPS = 100


def _stats(mean_s: float, count: int) -> dict:
    return {"total_seconds": mean_s * count, "self_seconds": mean_s * count, "mean_seconds": mean_s,
            "p50_seconds": mean_s, "p95_seconds": mean_s * 1.1, "p99_seconds": mean_s * 1.2,
            "max_seconds": mean_s * 1.3, "buckets": [0, count if mean_s <= 0.01 else 0, count if mean_s > 0.01 else 0,
                                                     0, 0, 0]}


def _entries(role: str, count: int) -> dict:
    return {name: {"count": count, "threads": [thread], "cpu": _stats(mean_s, count),
                   "share": mean_s * count / INTERVAL_S} for name, mean_s, thread in SPANS[role]}


def _records(rank: int, role: str, intervals: int):
    yield {"type": "run_start", "time_unix": T0, "rank": rank, "role": role, "schema": 1, "run_id": "long",
           "hostname": "host0", "interval_s": INTERVAL_S, "warmup_steps": STEPS, "phase_spans": [],
           "histogram_buckets_seconds": BOUNDS, "config": {"tokens_per_batch": 1024}}
    for k in range(intervals):
        t = T0 + (k + 1) * INTERVAL_S
        yield {"type": "spans", "time_unix": t, "rank": rank, "role": role, "index": k, "steps": [k * STEPS, k * STEPS],
               "dropped": 0, "spans": [{"id": 0, "parent": None, "name": SPANS[role][0][0], "thread": SPANS[role][0][2],
                                        "tid": 7, "depth": 0, "start_unix_ns": int((t - 1) * 1e9),
                                        "end_unix_ns": int((t - 0.95) * 1e9), "cpu_seconds": 0.05}]}
        yield {"type": "interval", "time_unix": t, "rank": rank, "role": role, "index": k, "step": (k + 1) * STEPS,
               "start_s": k * INTERVAL_S, "end_s": (k + 1) * INTERVAL_S, "duration_seconds": INTERVAL_S,
               "warmup": k == 0, "final": k == intervals - 1, "spans": _entries(role, STEPS),
               "counters": {"tokens": {"total": 1024 * STEPS, "per_second": 1024 * STEPS / INTERVAL_S,
                                       "run_total": 1024 * STEPS * (k + 1)}},
               "memory": {"available": False, "reason": "no CUDA device"}}
    steady_s = (intervals - 2) * INTERVAL_S
    yield {"type": "event", "kind": "throughput", "time_unix": T0 + intervals * INTERVAL_S, "rank": rank, "role": role,
           "window": "steady state", "steady_tokens_per_s": 1024 * STEPS / INTERVAL_S,
           "steady_tokens": 1024 * STEPS * (intervals - 2), "steady_seconds": steady_s,
           "steady_steps": STEPS * (intervals - 2)}


def write_long_run(run_dir: Path, intervals: int) -> Path:
    """RUN_DIR/profile/rank0.jsonl (drafter) and rank1.jsonl (target), `intervals` intervals each."""
    (run_dir / "profile").mkdir(parents=True)
    for rank, role in ((0, "drafter"), (1, "target")):
        with open(run_dir / "profile" / f"rank{rank}.jsonl", "w") as f:
            for rec in _records(rank, role, intervals):
                f.write(json.dumps(rec) + "\n")
    return run_dir
