"""End-to-end dflash-train on two GPUs (one target rank, one drafter rank) with a randomly initialised
Qwen3-8B-shaped target: NCCL vs host-staged transfer, every figure next to its floor or peer measured
in the same run (profiling on vs off: bench/overhead_ab.py).

    python3 bench/bench_pipeline.py [--steps 60] [--runs nccl,host] [--target DIR]
`transfer.send` is set against a bare NCCL send/recv of the same bytes, back to back (before and
after the runs, the faster kept) and at the run's cadence (after one step's idle time).
Needs 2 GPUs. Writes the runs under /tmp/dflash-bench and a JSON summary under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from profiler.records import read_records  # noqa: E402


def make_long_corpus(path: Path, n: int, words_per_turn: int, seed: int = 0) -> None:
    """Long conversations over the tiny tokenizer's vocabulary (one word = one token), so batches are
    2 x max_length tokens like the trainer's real shapes."""
    from dflash.tiny import VOCAB_WORDS

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            user = " ".join(rng.choice(VOCAB_WORDS) for _ in range(words_per_turn // 4))
            reply = " ".join(rng.choice(VOCAB_WORDS) for _ in range(words_per_turn))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")


def run_train(name: str, args: list[str], root: Path) -> Path:
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)   # a fresh run each time (the trainer refuses a used dir)
    cmd = [sys.executable, "-m", "dflash.cli", "--run-dir", str(run_dir), *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    print(f"--- {name}: exit {r.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-6000:], sep="\n")
        raise SystemExit(f"{name} failed")
    print(r.stdout[-2500:])
    return run_dir


def measure_peer(nbytes: int, gap_s: float = 0.0) -> dict:
    """Bare NCCL send/recv of `nbytes` (bench/nccl_p2p.py), back to back or after `gap_s` idle."""
    out = subprocess.run([sys.executable, str(REPO / "bench/nccl_p2p.py"), "--bytes", str(nbytes), "--reps", "30",
                          "--gap-seconds", str(gap_s)], capture_output=True, text=True, check=True, cwd=REPO).stdout
    peer = dict(json.loads(out.strip().splitlines()[-1]), gap_seconds=gap_s)
    print(f"peer: {json.dumps(peer)}", flush=True)
    return peer


def run_end(run_dir: Path, role: str) -> dict:
    for p in sorted((run_dir / "profile").glob("rank*.jsonl")):
        records, _ = read_records(p)
        for r in records:
            if r.get("type") == "run_end" and r.get("role") == role:
                return r
    return {}


def span(end: dict, name: str) -> dict:
    return end.get("spans", {}).get(name, {})


def steady_intervals(run_dir: Path, rank: int) -> list[dict]:
    """Interval records of the steady state: full-length intervals in which the target ran at least
    half as many forwards as in its best interval and never waited a whole second for a slot
    (start-up, the drafter's first-step compilation and the final partial interval fall out)."""
    records, _ = read_records(run_dir / "profile" / f"rank{rank}.jsonl")
    ivs = [r for r in records if r.get("type") == "interval"]
    fwd = lambda r: r["spans"].get("target.fwd", {}).get("count", 0)  # noqa: E731
    full = [r for r in ivs if r["duration_seconds"] >= 0.9 * max(x["duration_seconds"] for x in ivs)]
    # A single wait over a second is the drafter's compilation stall, not steady back-pressure.
    stall = lambda r: (r["spans"].get("transfer.wait_slot", {}).get("cpu") or {}).get("max_seconds", 0) > 1.0  # noqa: E731
    best = max((fwd(r) for r in full), default=0)
    return [r for r in full if best and fwd(r) >= best / 2 and not stall(r)]


def steady_tokens_per_s(run_dir: Path, rank: int = 1) -> float:
    """What the target produces in steady state, which the drafter consumes at equilibrium. The
    drafter-side meter (RUN_DIR/throughput) also counts batches buffered during start-up."""
    ivs = steady_intervals(run_dir, rank)
    tokens = sum(r["counters"].get("tokens", {}).get("total", 0) for r in ivs)
    return tokens / max(sum(r["duration_seconds"] for r in ivs), 1e-9)


def steady_step_seconds(run_dir: Path, rank: int = 1) -> float:
    """The target's steady time per batch: the pipeline's cadence, one transfer per batch."""
    ivs = steady_intervals(run_dir, rank)
    batches = sum(r["spans"].get("target.fwd", {}).get("count", 0) for r in ivs)
    return sum(r["duration_seconds"] for r in ivs) / max(batches, 1)


def busy_share(run_dir: Path, rank: int = 1) -> float:
    """Share of the target loop's steady-state time not spent waiting for a transfer slot."""
    busy = wait = 0.0
    for r in steady_intervals(run_dir, rank):
        busy += sum((r["spans"].get(n, {}).get("cpu") or {}).get("total_seconds", 0.0)
                    for n in ("target.fetch", "target.fwd", "target.pack_hidden", "d2h_copy"))
        wait += (r["spans"].get("transfer.wait_slot", {}).get("cpu") or {}).get("total_seconds", 0.0)
    return busy / max(busy + wait, 1e-9)


def steady_span(run_dir: Path, name: str, rank: int = 1) -> dict:
    """One span over the steady intervals: count, bytes, CPU and GPU totals, median GPU p50."""
    count = nbytes = cpu = gpu = 0.0
    p50s = []
    for r in steady_intervals(run_dir, rank):
        s = r["spans"].get(name)
        if not s:
            continue
        count += s["count"]
        nbytes += s.get("bytes") or 0
        cpu += (s.get("cpu") or {}).get("total_seconds") or 0.0
        if s.get("gpu"):
            gpu += s["gpu"]["total_seconds"] or 0.0
            p50s.append(s["gpu"]["p50_seconds"])
    p50s.sort()
    return {"count": count, "bytes": nbytes, "cpu_s": cpu, "gpu_s": gpu,
            "gpu_p50_s": p50s[len(p50s) // 2] if p50s else None,
            "gpu_bytes_per_s": nbytes / gpu if gpu else None, "cpu_bytes_per_s": nbytes / cpu if cpu else None}


def tail_rate(run_dir: Path) -> float:
    """The drafter meter's steady rate (after warm-up, phases left out), measured with or without profiling."""
    return json.loads((run_dir / "throughput" / "rank0.json").read_text())["steady_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--target", default="/tmp/dflash-bench/qwen3-8b-random")
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--runs", default="nccl,host", help="paths to run with profiling on (comma-separated)")
    ap.add_argument("--profile-interval", default="5")
    a = ap.parse_args()
    root = Path("/tmp/dflash-bench")
    root.mkdir(parents=True, exist_ok=True)
    if not (Path(a.target) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "bench/make_random_target.py"), "--out", a.target], check=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    data = root / "long.jsonl"
    make_long_corpus(data, 400, words_per_turn=a.max_length)
    common = ["--target-model", a.target, "--data", str(data), "--max-steps", str(a.steps),
              "--max-length", str(a.max_length), "--tokens-per-batch", str(2 * a.max_length),
              "--num-anchors", str(a.anchors), "--eval-prompts", "0", "--target-gpus", "1",
              "--drafter-gpus", "1", "--warmup-steps", "2", "--profile-interval", a.profile_interval]
    flags = {"nccl": ["--transfer", "nccl"], "host": ["--transfer", "host"]}
    summary: dict = {"command": sys.argv, "steps": a.steps}
    if a.runs:
        # The peers of `transfer.send`: a bare NCCL send/recv of one packed batch's bytes (K layers x
        # tokens x H x bf16). Back to back it moves by several percent from machine to machine, so
        # it is measured before and after the runs and the faster is kept (the stricter ratio).
        # A pipeline sends once per forward and the link idles in between; a bare send after that
        # much idle time is slower, so the same transfer is also measured at the run's cadence.
        payload_bytes = 5 * 2 * a.max_length * 4096 * 2
        before = measure_peer(payload_bytes)
        runs = {name: run_train(name, common + flags[name], root) for name in a.runs.split(",")}
        after = measure_peer(payload_bytes)
        peer = min((before, after), key=lambda p: p["nccl_seconds"])
        summary["rows"] = rows = [path_row(name, run_dir) for name, run_dir in runs.items()]
        period_s = rows[0]["step_seconds"]
        peer["cadence"] = measure_peer(payload_bytes, gap_s=round(period_s, 3))
        summary["nccl_peer"], summary["nccl_peer_runs"] = peer, [before, after]
        print_paths(rows, peer)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_pipeline.json").write_text(json.dumps(summary, indent=2))


def path_row(name: str, run_dir: Path) -> dict:
    t_end = run_end(run_dir, "target")
    pack, send, d2h = (steady_span(run_dir, n) for n in ("target.pack_hidden", "transfer.send", "d2h_copy"))
    fwd = steady_span(run_dir, "target.fwd")
    ivs = steady_intervals(run_dir, 1)
    return {"run": name, "steady_intervals": [r["index"] for r in ivs],
            "tokens_per_s": steady_tokens_per_s(run_dir), "drafter_tail_tokens_per_s": tail_rate(run_dir),
            "target_busy_share": busy_share(run_dir),
            "fwd_gpu_ms": 1e3 * fwd["gpu_s"] / max(fwd["count"], 1),
            "step_seconds": steady_step_seconds(run_dir),
            "pack_gpu_ms": 1e3 * pack["gpu_s"] / max(pack["count"], 1),
            "pack_floor_ratio": span(t_end, "target.pack_hidden").get("floor_ratio"),
            "pack_floor_bytes_per_s": span(t_end, "target.pack_hidden").get("floor_bytes_per_s"),
            "pack_bytes_per_s": pack["gpu_bytes_per_s"],
            "send": send, "d2h": d2h,
            "d2h_floor_bytes_per_s": span(t_end, "d2h_copy").get("floor_bytes_per_s"),
            "drafter_fwd_bwd_gpu_ms": 1e3 * ((span(run_end(run_dir, "drafter"), "drafter.fwd_bwd").get("gpu") or {})
                                             .get("p50_seconds") or float("nan"))}


def print_paths(rows: list[dict], peer: dict) -> None:
    cad = peer["cadence"]
    print("\n| run | tokens/s (steady) | target busy | fwd GPU ms | pack GPU ms (x floor time) "
          "| send GPU ms p50 | send GB/s | of peer back to back | of peer at cadence "
          "| d2h GB/s (of pinned floor) | drafter fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pack_x = (r["pack_floor_bytes_per_s"] / r["pack_bytes_per_s"]) if r["pack_bytes_per_s"] else float("nan")
        send_bw = r["send"]["gpu_bytes_per_s"] or r["send"]["cpu_bytes_per_s"] or 0
        d2h_bw = r["d2h"]["gpu_bytes_per_s"]
        d2h = (f"{d2h_bw / 1e9:.1f} ({d2h_bw / r['d2h_floor_bytes_per_s']:.2f})"
               if d2h_bw and r["d2h_floor_bytes_per_s"] else "n/a")
        print(f"| {r['run']} | {r['tokens_per_s']:,.0f} | {r['target_busy_share']:.1%} | {r['fwd_gpu_ms']:.1f} "
              f"| {r['pack_gpu_ms']:.3f} ({pack_x:.2f}x) | {1e3 * (r['send']['gpu_p50_s'] or float('nan')):.2f} "
              f"| {send_bw / 1e9:.1f} | {send_bw / peer['nccl_bytes_per_s']:.2f} "
              f"| {send_bw / cad['nccl_bytes_per_s']:.2f} | {d2h} | {r['drafter_fwd_bwd_gpu_ms']:.1f} |")
    print(f"peer: bare NCCL send/recv of {peer['bytes'] / 1e6:.0f} MB back to back {peer['nccl_seconds'] * 1e3:.2f} ms = "
          f"{peer['nccl_bytes_per_s'] / 1e9:.1f} GB/s (faster of before/after the runs); after "
          f"{cad['gap_seconds']:.3f} s idle, the run's cadence, {cad['nccl_seconds'] * 1e3:.2f} ms = "
          f"{cad['nccl_bytes_per_s'] / 1e9:.1f} GB/s; pinned D2H+H2D {peer['pinned_seconds'] * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
