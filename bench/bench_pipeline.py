"""End-to-end dflash-train on two GPUs (one target rank, one drafter rank) with a randomly initialised
Qwen3-8B-shaped target: NCCL vs host-staged transfer, every figure next to its floor or peer measured
in the same run (profiling on vs off: bench/overhead_ab.py).

    python3 bench/bench_pipeline.py [--steps 60] [--runs nccl,host] [--target DIR]
`transfer.send` is set against a bare NCCL send/recv of the same bytes, back to back (before and
after the runs, the faster kept) and at the run's cadence (after one step's idle time).
Needs 2 GPUs. Writes the runs under /tmp/dflash-bench and a JSON summary under $OUT when set.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
from common import REPO


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
    """A fresh run ROOT/NAME (the trainer refuses a used dir); the tail of its output is printed."""
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    r = common.train(run_dir, args, capture_output=True, text=True)
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


def steady_intervals(run_dir: Path, rank: int = 1) -> list[dict]:
    """Interval records of the steady state: full-length intervals in which the target ran at least
    half as many forwards as in its best interval and never waited a whole second for a slot
    (start-up, the drafter's first-step compilation and the final partial interval fall out)."""
    ivs = common.records(run_dir, rank, "interval")
    fwd = lambda r: r["spans"].get("target.fwd", {}).get("count", 0)  # noqa: E731
    full = [r for r in ivs if r["duration_seconds"] >= 0.9 * max(x["duration_seconds"] for x in ivs)]
    # A single wait over a second is the drafter's compilation stall, not steady back-pressure.
    stall = lambda r: (r["spans"].get("transfer.wait_slot", {}).get("cpu") or {}).get("max_seconds", 0) > 1.0  # noqa: E731
    best = max((fwd(r) for r in full), default=0)
    return [r for r in full if best and fwd(r) >= best / 2 and not stall(r)]


def steady_span(ivs: list[dict], name: str) -> dict:
    """One span over the steady intervals `ivs`: count, bytes, CPU and GPU totals, median GPU p50."""
    count = nbytes = cpu = gpu = 0.0
    p50s = []
    for r in ivs:
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


def main() -> None:
    ap = common.parser(__doc__)
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
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    data = root / "long.jsonl"
    make_long_corpus(data, 400, words_per_turn=a.max_length)
    args = ["--target-model", a.target, "--data", str(data), "--max-steps", str(a.steps),
            "--max-length", str(a.max_length), "--tokens-per-batch", str(2 * a.max_length),
            "--num-anchors", str(a.anchors), "--eval-prompts", "0", "--target-gpus", "1",
            "--drafter-gpus", "1", "--warmup-steps", "2", "--profile-interval", a.profile_interval]
    summary: dict = {"command": sys.argv, "steps": a.steps}
    if a.runs:
        # The peers of `transfer.send`: a bare NCCL send/recv of one packed batch's bytes (K layers x
        # tokens x H x bf16). Back to back it moves by several percent from machine to machine, so
        # it is measured before and after the runs and the faster is kept (the stricter ratio).
        # A pipeline sends once per forward and the link idles in between; a bare send after that
        # much idle time is slower, so the same transfer is also measured at the run's cadence.
        payload_bytes = 5 * 2 * a.max_length * 4096 * 2
        before = measure_peer(payload_bytes)
        runs = {name: run_train(name, [*args, "--transfer", name], root) for name in a.runs.split(",")}
        after = measure_peer(payload_bytes)
        peer = min((before, after), key=lambda p: p["nccl_seconds"])
        summary["rows"] = rows = [path_row(name, run_dir) for name, run_dir in runs.items()]
        peer["cadence"] = measure_peer(payload_bytes, gap_s=round(rows[0]["step_seconds"], 3))
        summary["nccl_peer"], summary["nccl_peer_runs"] = peer, [before, after]
        print_paths(rows, peer)
    common.write_out("bench_pipeline.json", summary)


def path_row(name: str, run_dir: Path) -> dict:
    """One run's figures from the target's (rank 1) steady intervals and both ranks' run_end records."""
    ivs = steady_intervals(run_dir)
    sp = {n: steady_span(ivs, n) for n in ("target.fetch", "target.fwd", "target.pack_hidden", "d2h_copy",
                                           "transfer.wait_slot", "transfer.send")}
    seconds = sum(r["duration_seconds"] for r in ivs)
    # The target's busy share: its loop's steady time not spent waiting for a transfer slot.
    busy = sum(sp[n]["cpu_s"] for n in ("target.fetch", "target.fwd", "target.pack_hidden", "d2h_copy"))
    ends = {rank: next(iter(common.records(run_dir, rank, "run_end")), {}).get("spans", {}) for rank in (0, 1)}
    pack_end, pack = ends[1].get("target.pack_hidden", {}), sp["target.pack_hidden"]
    # tokens/s: what the target produces in steady state, which the drafter consumes at equilibrium (the
    # drafter-side meter, RUN_DIR/throughput, also counts batches buffered during start-up).
    return {"run": name, "steady_intervals": [r["index"] for r in ivs],
            "tokens_per_s": sum(r["counters"].get("tokens", {}).get("total", 0) for r in ivs) / max(seconds, 1e-9),
            "target_busy_share": busy / max(busy + sp["transfer.wait_slot"]["cpu_s"], 1e-9),
            "fwd_gpu_ms": 1e3 * sp["target.fwd"]["gpu_s"] / max(sp["target.fwd"]["count"], 1),
            "step_seconds": seconds / max(sp["target.fwd"]["count"], 1),   # the cadence: one transfer a batch
            "pack_gpu_ms": 1e3 * pack["gpu_s"] / max(pack["count"], 1),
            "pack_floor_ratio": pack_end.get("floor_ratio"),
            "pack_floor_bytes_per_s": pack_end.get("floor_bytes_per_s"),
            "pack_bytes_per_s": pack["gpu_bytes_per_s"], "send": sp["transfer.send"], "d2h": sp["d2h_copy"],
            "d2h_floor_bytes_per_s": ends[1].get("d2h_copy", {}).get("floor_bytes_per_s"),
            "drafter_fwd_bwd_gpu_ms": 1e3 * ((ends[0].get("drafter.fwd_bwd", {}).get("gpu") or {})
                                             .get("p50_seconds") or float("nan"))}


def print_paths(rows: list[dict], peer: dict) -> None:
    """The runs' table, each figure next to its floor or peer, and the peer's own line."""
    cad, cells = peer["cadence"], []
    for r in rows:
        pack_x = (r["pack_floor_bytes_per_s"] / r["pack_bytes_per_s"]) if r["pack_bytes_per_s"] else float("nan")
        send_bw = r["send"]["gpu_bytes_per_s"] or r["send"]["cpu_bytes_per_s"] or 0
        d2h_bw = r["d2h"]["gpu_bytes_per_s"]
        d2h = (f"{d2h_bw / 1e9:.1f} ({d2h_bw / r['d2h_floor_bytes_per_s']:.2f})"
               if d2h_bw and r["d2h_floor_bytes_per_s"] else "n/a")
        cells.append([r["run"], f"{r['tokens_per_s']:,.0f}", f"{r['target_busy_share']:.1%}",
                      f"{r['fwd_gpu_ms']:.1f}", f"{r['pack_gpu_ms']:.3f} ({pack_x:.2f}x)",
                      f"{1e3 * (r['send']['gpu_p50_s'] or float('nan')):.2f}",
                      f"{send_bw / 1e9:.1f}", f"{send_bw / peer['nccl_bytes_per_s']:.2f}",
                      f"{send_bw / cad['nccl_bytes_per_s']:.2f}", d2h, f"{r['drafter_fwd_bwd_gpu_ms']:.1f}"])
    print("\n" + common.table(["run", "tokens/s (steady)", "target busy", "fwd GPU ms", "pack GPU ms (x floor time)",
                               "send GPU ms p50", "send GB/s", "of peer back to back", "of peer at cadence",
                               "d2h GB/s (of pinned floor)", "drafter fwd+bwd ms"], cells))
    print(f"peer: bare NCCL send/recv of {peer['bytes'] / 1e6:.0f} MB back to back {peer['nccl_seconds'] * 1e3:.2f} ms = "
          f"{peer['nccl_bytes_per_s'] / 1e9:.1f} GB/s (faster of before/after the runs); after "
          f"{cad['gap_seconds']:.3f} s idle, the run's cadence, {cad['nccl_seconds'] * 1e3:.2f} ms = "
          f"{cad['nccl_bytes_per_s'] / 1e9:.1f} GB/s; pinned D2H+H2D {peer['pinned_seconds'] * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
