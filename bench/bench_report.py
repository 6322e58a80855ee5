"""dflash-report on long runs: generates the run logs of an 8-rank run at a 60 s profile interval (5 target ranks
feeding 3 drafter ranks, as the seeds ran it) in the schema-1 shape of docs/RUNLOG.md: every interval with CPU and
GPU stats and histogram buckets per span (target.fetch, host work, CPU-timed only), NVML and allocator memory,
threads, a detail-window `spans` record before it, stack samples every 10th interval, hourly checkpoints. Then, at
each size of `--sizes` (MB of logs), runs `hotspots --json`, `check`, `trace` and `hotspots --compare` (the run
against itself) through the CLI (`python -m dflash.report_cli`, what a user waits for), each timed end to end with
its peak RSS, and says whether the time grows linearly with the log (seconds per MB at the largest size within
LINEAR_SLACK of the smallest's). `--hours` times only `hotspots` on a log of that many hours instead (the old
24-hour figure). `--split-check` and `--memory-check` hold the report's split advice and memory model against real
runs, reading them from the same CLI's JSON.

    python bench/bench_report.py [--sizes 100,300,1000] [--ranks 8] [--targets 5] [--interval 60] [--dir DIR]
    python bench/bench_report.py --hours 24 [--repeat 3]

The numbers inside the generated logs are synthetic (a seeded random walk around GPU-like step times);
what is measured is the report's time and memory on a log of the real size and shape.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import REPO

BOUNDS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
          10.0, 30.0, 60.0, 120.0, 300.0]
GIB = 1024 ** 3
CPU_ONLY = ("target.fetch",)   # host work: no GPU times, so the report reads it on the CPU clock over every entry
# role -> [(span, seconds per call, bytes per call or None, thread)]; one call per step
SPANS = {
    "target": [("target.fetch", 0.002, None, "target.main"), ("target.fwd", 1.10, None, "target.main"),
               ("target.pack_hidden", 0.12, 2_600_000_000, "target.main"),
               ("transfer.wait_slot", 0.05, None, "target.main"),
               ("transfer.send", 0.35, 1_300_000_000, "target.sender")],
    "drafter": [("drafter.recv", 0.05, None, "drafter.main"), ("h2d_copy", 0.04, 1_300_000_000, "drafter.main"),
                ("drafter.fwd_bwd", 0.75, None, "drafter.main"), ("drafter.allreduce", 0.04, None, "drafter.main"),
                ("drafter.optim", 0.02, None, "drafter.main")],
}


def _stats(rng: random.Random, mean_s: float, count: int) -> dict:
    samples = sorted(max(1e-6, rng.gauss(mean_s, mean_s * 0.08)) for _ in range(min(count, 16)))
    buckets = [0] * (len(BOUNDS) + 1)
    for s in samples:
        buckets[next((i for i, b in enumerate(BOUNDS) if s <= b), len(BOUNDS))] += count / len(samples)
    q = lambda f: samples[min(len(samples) - 1, int(f * len(samples)))]  # noqa: E731
    return {"total_seconds": mean_s * count, "mean_seconds": mean_s, "p50_seconds": q(0.5), "p95_seconds": q(0.95),
            "p99_seconds": q(0.99), "max_seconds": samples[-1], "buckets": [round(b) for b in buckets]}


def _span_entries(rng: random.Random, role: str, steps: int, slow: float) -> dict:
    out = {}
    for name, mean_s, nbytes, thread in SPANS[role]:
        m = mean_s * slow * rng.uniform(0.95, 1.05)
        e = {"count": steps, "threads": [thread], "cpu": _stats(rng, m * 0.2, steps),
             **({} if name in CPU_ONLY else {"gpu": _stats(rng, m, steps)}),
             "share": m * steps / 60.0}
        if nbytes:
            e.update(bytes=nbytes * steps, bandwidth_bytes_per_s=nbytes / m, floor="device_copy",
                     floor_bytes_per_s=2.0e12, floor_ratio=nbytes / m / 2.0e12)
        out[name] = e
    return out


def _memory(rng: random.Random, k: int, role: str, gpu: int) -> dict:
    total = 141 * GIB
    base = (96 if role == "target" else 70) * GIB
    peak = base + rng.uniform(0, 25) * GIB + (k / 1440) * 8 * GIB
    return {"available": True, "sampler_errors": 0,
            "gpus": [{"index": gpu, "name": "NVIDIA H200", "total_bytes": total, "used_bytes_last": int(peak - GIB),
                      "used_bytes_peak": int(peak), "headroom_bytes": int(total - peak), "util_percent_mean": 92.0,
                      "power_watts_mean": 610.0, "temperature_c_max": 71.0, "sm_clock_hz_last": 1_980_000_000,
                      "throttle_reasons": [], "samples": 120}],
            "allocator": {"available": True, "allocated_bytes": int(base - 30 * GIB),
                          "reserved_bytes": int(peak - 2 * GIB),
                          "peak_allocated_bytes": int(peak - 4 * GIB), "peak_reserved_bytes": int(peak - GIB),
                          "num_alloc_retries": k // 500, "num_ooms": 0, "inactive_split_bytes": 300_000_000}}


def _detail(rng: random.Random, role: str, t_ns: int, steps: int = 3) -> list:
    """The raw spans of a 3-step detail window."""
    out, sid = [], 0
    for _ in range(steps):
        for name, mean_s, nbytes, thread in SPANS[role]:
            d_ns = int(mean_s * rng.uniform(0.9, 1.1) * 1e9)
            out.append({"id": sid, "parent": None, "name": name, "thread": thread, "tid": 4000 + len(thread),
                        "depth": 0, "start_unix_ns": t_ns, "end_unix_ns": t_ns + d_ns, "cpu_seconds": d_ns / 5e9,
                        "gpu_seconds": d_ns / 1e9, "bytes": nbytes})
            sid, t_ns = sid + 1, t_ns + d_ns
    return out


def _stacks(role: str) -> dict:
    return {"samples": 20, "threads": [{"name": f"{role}.main", "native_id": 4011, "top_frames": [
        {"frame": f"forward ({role}.py:120)", "count": 12}, {"frame": "_conv_forward (conv.py:456)", "count": 5}]}]}


def _rank_records(rank: int, role: str, hours: float, interval_s: float, t0: float, slow: float):
    """The rank's records, one at a time (a 1 GB log is written without holding it)."""
    rng = random.Random(rank)
    step_s = sum(m for _, m, _, t in SPANS[role] if t.endswith("main")) * slow
    steps = max(1, int(interval_s / step_s))
    yield {"type": "run_start", "time_unix": t0, "rank": rank, "role": role, "schema": 1, "run_id": "bench-24h",
             "clock": {"perf_counter_ns": 0, "unix_ns": int(t0 * 1e9)}, "histogram_buckets_seconds": BOUNDS,
             "detail_steps": 3, "world_size": 8, "pid": 1000 + rank, "hostname": "node0", "device": "cuda",
             "device_name": "NVIDIA H200", "floors": {"device_copy": 2.0e12, "pinned_d2h": 5.0e10,
                                                       "pinned_h2d": 5.0e10}, "interval_s": interval_s,
             "config": {"tokens_per_batch": 65536, "max_in_flight": 2, "target_gpus": 5, "drafter_gpus": 3}}
    for k in range(int(hours * 3600 / interval_s)):
        t = t0 + (k + 1) * interval_s
        yield {"type": "spans", "time_unix": t, "rank": rank, "role": role, "index": k,
               "steps": [k * steps, k * steps + 2], "spans": _detail(rng, role, int((t - interval_s) * 1e9)),
               "dropped": 0}
        rec = {"type": "interval", "time_unix": t, "rank": rank, "role": role, "index": k, "step": (k + 1) * steps,
               "start_s": k * interval_s, "end_s": (k + 1) * interval_s, "duration_seconds": interval_s,
               "spans": _span_entries(rng, role, steps, slow),
               "counters": {"tokens": {"total": 65536 * steps, "per_second": 65536 * steps / interval_s,
                                       "run_total": 65536 * steps * (k + 1)}},
               "gauges": {"queue_depth": {"last": 1.0, "mean": 0.8, "max": 2.0}} if role == "drafter" else {},
               "metrics": {"loss": {"last": 2.0, "mean": 2.1}, "tau": {"last": 3.1, "mean": 3.0}},
               "memory": _memory(rng, k, role, rank), "threads": [{"name": f"{role}.main", "native_id": 4011}],
               "exporters": {"prometheus": {"exported": k, "dropped": 0, "failed": 0}}}
        if k % 10 == 0:
            rec["stack_samples"] = _stacks(role)
        yield rec
        if role == "drafter" and k % 60 == 59:
            yield {"type": "event", "time_unix": t, "rank": rank, "role": role, "kind": "checkpoint",
                   "step": (k + 1) * steps, "path": f"checkpoints/step_{(k + 1) * steps}", "seconds": 4.2}
    n = int(hours * 3600 / interval_s)
    yield {"type": "run_end", "time_unix": t0 + n * interval_s, "rank": rank, "role": role, "step": n * steps,
           "status": "ok", "duration_seconds": n * interval_s, "intervals": n,
           "spans": _span_entries(rng, role, n * steps, slow),
           "counters": {"tokens": {"total": 65536 * steps * n, "per_second": 65536 * steps / interval_s}}}


def generate(run_dir: Path, hours: float, ranks: int, targets: int, interval_s: float) -> int:
    """Write RUN_DIR/profile/rank{R}.jsonl; drafters are ranks 0..D-1. Rank 3 is 30% slower (a straggler).
    Returns the bytes written."""
    (run_dir / "profile").mkdir(parents=True, exist_ok=True)
    t0, size = 1_700_000_000.0, 0
    for rank in range(ranks):
        role = "drafter" if rank < ranks - targets else "target"
        with open(run_dir / "profile" / f"rank{rank}.jsonl", "w") as f:
            for rec in _rank_records(rank, role, hours, interval_s, t0, slow=1.3 if rank == 3 else 1.0):
                size += f.write(json.dumps(rec) + "\n")
    return size


def hotspots(run_dir: Path, *more: str, **kw) -> subprocess.CompletedProcess:
    """`dflash-report hotspots RUN_DIR --json MORE` (what a user runs), to its end."""
    return subprocess.run([sys.executable, "-m", "dflash.report_cli", "hotspots", str(run_dir), "--json", *more],
                          cwd=REPO, check=True, **kw)


def report_json(run_dir: Path, gpus: int | None = None) -> dict:
    """hotspots' JSON, parsed; `gpus` asks its split advice for that many GPUs."""
    return json.loads(hotspots(run_dir, *(["--gpus", str(gpus)] if gpus else []), capture_output=True).stdout)


def time_cli(run_dir: Path, repeat: int) -> list:
    """Wall seconds of `repeat` whole hotspots runs, end to end (interpreter start to exit)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        hotspots(run_dir, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return times


# ---- time and memory at several sizes: linear in the log ------------------------------------------

LINEAR_SLACK = 1.5
"""Time grows linearly when the largest size's seconds per MB are within this factor of the smallest's."""
TARGET_SECONDS, TARGET_RSS_BYTES = 20.0, 2 * GIB   # issue 46: each command at 1 GB on the 2-core VM
COMMANDS = {"hotspots": ["hotspots", "{run}", "--json"], "check": ["check", "{run}"],
            "trace": ["trace", "{run}", "-o", "{out}"],
            "compare": ["hotspots", "{run}", "--compare", "{run}", "--json"]}


def measure(args: list) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, peak RSS bytes, exit status) of one `python -m dflash.report_cli ARGS` run to its
    end (CPU seconds: what a shared, busy machine cannot inflate as it does the wall clock)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dflash.report_cli", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)   # this child's own rusage: its peak RSS alone
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, proc.returncode


def bytes_per_interval(ranks: int, targets: int, interval_s: float) -> float:
    """Log bytes one interval of every rank adds (a 20-interval probe)."""
    with tempfile.TemporaryDirectory() as tmp:
        return generate(Path(tmp) / "probe", 20 * interval_s / 3600, ranks, targets, interval_s) / 20


def size_rows(work: Path, sizes_mb: list, ranks: int, targets: int, interval_s: float) -> list:
    """One row per size and command: {size_mb, intervals (per rank), command, seconds, cpu_seconds, rss_bytes,
    status}; each size's logs are removed once measured."""
    per_interval, rows = bytes_per_interval(ranks, targets, interval_s), []
    for mb in sizes_mb:
        run_dir = work / f"run-{mb}mb"
        intervals = max(1, round(mb * 1e6 / per_interval))
        written = generate(run_dir, intervals * interval_s / 3600, ranks, targets, interval_s)
        for name, template in COMMANDS.items():
            args = [a.format(run=run_dir, out=work / "trace.json") for a in template]
            seconds, cpu_s, rss, status = measure(args)
            rows.append({"size_mb": written / 1e6, "intervals": intervals, "command": name, "seconds": seconds,
                         "cpu_seconds": cpu_s, "rss_bytes": rss, "status": status})
            print(f"{written / 1e6:.0f} MB {name}: {seconds:.2f} s ({cpu_s:.2f} s CPU), {rss / 2 ** 20:.0f} MiB peak, "
                  f"exit {status}", flush=True)
        shutil.rmtree(run_dir)
    return rows


def linearity(rows: list) -> dict:
    """{command: (smallest size's s/MB, largest's, linear?)} over the rows' sizes."""
    out = {}
    for name in COMMANDS:
        mine = sorted((r for r in rows if r["command"] == name), key=lambda r: r["size_mb"])
        first, last = (mine[0]["seconds"] / mine[0]["size_mb"], mine[-1]["seconds"] / mine[-1]["size_mb"])
        out[name] = (first, last, last <= LINEAR_SLACK * first)
    return out


def main_sizes(args) -> int:
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = size_rows(Path(args.dir or tmp), sizes, args.ranks, args.targets, args.interval)
    print(common.table(["log MB", "intervals/rank", "command", "seconds", "CPU seconds", "peak RSS MiB", "exit"],
                       [[f"{r['size_mb']:.0f}", r["intervals"], r["command"], f"{r['seconds']:.2f}",
                         f"{r['cpu_seconds']:.2f}", f"{r['rss_bytes'] / 2 ** 20:.0f}", r["status"]] for r in rows]))
    lin = linearity(rows)
    for name, (first, last, ok) in lin.items():
        print(f"{name}: {first * 100:.3f} s per 100 MB at the smallest size, {last * 100:.3f} at the largest: "
              + ("linear" if ok else f"NOT linear (over {LINEAR_SLACK}x)"))
    big = [r for r in rows if r["size_mb"] >= 900]
    for r in big:
        print(f"{r['command']} at {r['size_mb']:.0f} MB: {r['seconds']:.1f} s (target < {TARGET_SECONDS:g} s), "
              f"{r['rss_bytes'] / GIB:.2f} GiB peak (target < {TARGET_RSS_BYTES / GIB:g} GiB)")
    print(f"cpu: {os.cpu_count()} cores; python {sys.version.split()[0]}; one run per size and command")
    ok = all(v[2] for v in lin.values()) and all(r["seconds"] < TARGET_SECONDS and r["rss_bytes"] < TARGET_RSS_BYTES
                                                  for r in big)
    return 0 if ok else 1


# ---- the split advice against real runs of the splits it predicts ---------------------------------

SPLIT_ARGS = ["--builtin-conversations", "96", "--eval-prompts", "0", "--tokens-per-batch", "1024",
              "--max-length", "128", "--profile-interval", "2", "--device", "cpu"]


def _train(run_dir: Path, targets: int, drafters: int, steps: int, fault: str) -> None:
    """One CPU run; dflash-train gives each of its processes one torch thread on 2 cores (2 // world)."""
    common.train(run_dir, ["--max-steps", steps, "--target-gpus", targets, "--drafter-gpus", drafters, *SPLIT_ARGS],
                 env={"DFLASH_FAULT": fault}, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def split_check(work: Path, fault: str, splits: list, steps: int) -> list:
    """Calibrate on a 1:1 run, predict every split in `splits` with the report's split advice, run each,
    and return rows (split, predicted, measured, error) with the calibration's capacities."""
    _train(work / "1x1", 1, 1, steps, fault)
    rows = []
    for t, d in splits:
        advice = report_json(work / "1x1", gpus=t + d)["split"]
        predicted = next(x["predicted_tokens_per_s"] for x in advice["splits"]
                         if (x["target_gpus"], x["drafter_gpus"]) == (t, d))
        run = work / f"{t}x{d}"
        _train(run, t, d, steps * max(1, t // d), fault)
        # --gpus: the report gives a CPU run's split only for a number of GPUs it is asked about.
        measured = report_json(run, gpus=t + d)["split"]["current"]["measured_tokens_per_s"]
        best = advice["best"]
        rows.append({"split": f"{t}:{d}", "best_for_n": f"{best['target_gpus']}:{best['drafter_gpus']}",
                     "predicted": predicted, "measured": measured, "error": measured / predicted - 1,
                     "capacity": {r: c["capacity_tokens_per_s_per_gpu"] for r, c in advice["roles"].items()}})
    return rows


def main_split(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.dir or tmp) / "split"
        splits = [tuple(int(x) for x in s.split(":")) for s in args.splits.split(",")]
        rows = split_check(work, args.fault, splits, args.steps)
    print(f"calibration 1:1 with DFLASH_FAULT={args.fault}: capacity per GPU "
          + ", ".join(f"{r} {c:.0f} tokens/s" for r, c in rows[0]["capacity"].items()))
    print(common.table(["split", "best for N", "predicted", "measured", "error"],
                       [[r["split"], r["best_for_n"], f"{r['predicted']:.0f}", f"{r['measured']:.0f}",
                         f"{r['error']:+.1%}"] for r in rows]))
    return 0 if all(abs(r["error"]) <= 0.2 for r in rows) else 1


# ---- the memory model against runs at other tokens per batch -------------------------------------

def memory_check(run_dirs: list) -> list:
    """From each run's memory model (the report's `memory_margin`), predict the NVML peak used of every
    later run (another tokens per batch, same config otherwise) with linear and with quadratic growth in
    the mean tokens a batch held."""
    models = [(Path(d).name, report_json(Path(d))["memory_margin"]) for d in run_dirs]
    rows = []
    for i, (src, a) in enumerate(models):
        ga = a["gpus"][0]
        for dst, b in models[i + 1:]:
            gb = b["gpus"][0]
            ratio = b["mean_tokens_per_batch"] / a["mean_tokens_per_batch"]
            for k in (1, 2):
                predicted = ga["fixed_bytes"] + ga["per_batch_bytes"] * ratio ** k
                rows.append({"from": f"{src} ({a['mean_tokens_per_batch']:.0f})",
                             "to": f"{dst} ({b['mean_tokens_per_batch']:.0f})",
                             "growth": "linear" if k == 1 else "quadratic", "predicted_gib": predicted / GIB,
                             "measured_gib": gb["used_bytes_peak"] / GIB,
                             "error": predicted / gb["used_bytes_peak"] - 1})
    return rows


def main_memory(run_dirs: list) -> int:
    print(common.table(["from (tokens/batch)", "to (tokens/batch)", "growth", "predicted GiB", "measured GiB", "error"],
                       [[r["from"], r["to"], r["growth"], f"{r['predicted_gib']:.2f}", f"{r['measured_gib']:.2f}",
                         f"{r['error']:+.1%}"] for r in memory_check(run_dirs)]))
    return 0


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--split-check", action="store_true", help="check the split advice against real CPU runs instead")
    p.add_argument("--memory-check", nargs="+", metavar="RUN_DIR",
                   help="check the memory model across runs at growing tokens per batch instead")
    p.add_argument("--fault", default="slow=0.4@target.fwd", help="DFLASH_FAULT of every split-check run")
    p.add_argument("--splits", default="2:1", help="T:D splits to run, comma-separated (split check)")
    p.add_argument("--steps", type=int, default=40, help="drafter steps of the 1:1 run (split check)")
    p.add_argument("--sizes", default="100,300,1000", help="MB of logs to time every command at (comma-separated)")
    p.add_argument("--hours", type=float, help="time only hotspots on a log of this many hours instead")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--targets", type=int, default=5)
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("--dir", help="where to write the run (default: a temporary directory, removed after)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if args.split_check:
        return main_split(args)
    if args.memory_check:
        return main_memory(args.memory_check)
    if args.hours is None:
        return main_sizes(args)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.dir or tmp) / "bench-24h"
        t = time.perf_counter()
        size = generate(run_dir, args.hours, args.ranks, args.targets, args.interval)
        print(f"generated {args.hours:g} h x {args.ranks} ranks at {args.interval:g} s: "
              f"{size / 1e6:.0f} MB in {time.perf_counter() - t:.1f} s ({run_dir})")
        cli = time_cli(run_dir, args.repeat)
        print(f"report CLI --json end to end: median {statistics.median(cli):.2f} s, "
              f"all {', '.join(f'{x:.2f}' for x in cli)}")
        print(f"cpu: {os.cpu_count()} cores; python {sys.version.split()[0]}")
        return 0 if statistics.median(cli) < 3.0 else 1


if __name__ == "__main__":
    sys.exit(main())
