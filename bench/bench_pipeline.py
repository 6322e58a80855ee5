"""End-to-end dflash-train on two GPUs (one target rank, one drafter rank) with a randomly initialised
Qwen3-8B-shaped target: NCCL vs host-staged transfer, profiling on vs off, every figure next to its
floor or peer measured in the same run.

    python3 bench/bench_pipeline.py [--steps 40] [--target DIR]
Needs 2 GPUs. Writes the runs under /tmp/dflash-bench and a JSON summary under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from profiler.runlog import read_records  # noqa: E402


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
    cmd = [sys.executable, "-m", "dflash.cli", "--run-dir", str(run_dir), *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    print(f"--- {name}: exit {r.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-6000:], sep="\n")
        raise SystemExit(f"{name} failed")
    print(r.stdout[-2500:])
    return run_dir


def run_end(run_dir: Path, role: str) -> dict:
    for p in sorted((run_dir / "profile").glob("rank*.jsonl")):
        records, _ = read_records(p)
        for r in records:
            if r.get("type") == "run_end" and r.get("role") == role:
                return r
    return {}


def throughput(run_dir: Path) -> float:
    return json.loads((run_dir / "throughput" / "rank0.json").read_text())["tokens_per_s"]


def span(end: dict, name: str) -> dict:
    return end.get("spans", {}).get(name, {})


def gpu_or_cpu_total(s: dict) -> float:
    return ((s.get("gpu") or s.get("cpu") or {}).get("total_seconds")) or 0.0


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


def busy_share(run_dir: Path, rank: int = 1) -> float:
    """Share of the target loop's steady-state time not spent waiting for a transfer slot."""
    busy = wait = 0.0
    for r in steady_intervals(run_dir, rank):
        busy += sum((r["spans"].get(n, {}).get("cpu") or {}).get("total_seconds", 0.0)
                    for n in ("target.fetch", "target.fwd", "target.pack_hidden", "d2h_copy"))
        wait += (r["spans"].get("transfer.wait_slot", {}).get("cpu") or {}).get("total_seconds", 0.0)
    return busy / max(busy + wait, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--target", default="/tmp/dflash-bench/qwen3-8b-random")
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--runs", default="nccl,nccl_noprof,host", help="which runs to make (comma-separated)")
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
    flags = {"nccl": ["--transfer", "nccl"], "nccl_noprof": ["--transfer", "nccl", "--no-profile"],
             "host": ["--transfer", "host"]}
    # The peer first: a bare NCCL send/recv of one packed batch's bytes (K layers x tokens x H x bf16).
    payload_bytes = 5 * 2 * a.max_length * 4096 * 2
    peer = json.loads(subprocess.run([sys.executable, str(REPO / "bench/nccl_p2p.py"), "--bytes",
                                      str(payload_bytes)], capture_output=True, text=True, check=True,
                                     cwd=REPO).stdout.strip().splitlines()[-1])
    print(f"peer: {json.dumps(peer)}", flush=True)
    runs = {name: run_train(name, common + flags[name], root) for name in a.runs.split(",")}
    rows = []
    for name in [n for n in ("nccl", "host") if n in runs]:
        t_end, d_end = run_end(runs[name], "target"), run_end(runs[name], "drafter")
        pack, send = span(t_end, "target.pack_hidden"), span(t_end, "transfer.send")
        row = {"run": name, "tokens_per_s": steady_tokens_per_s(runs[name]),
               "drafter_meter_tokens_per_s": throughput(runs[name]), "target_busy_share": busy_share(runs[name]),
               "pack_ms": 1e3 * gpu_or_cpu_total(pack) / max(1, pack.get("count", 1)),
               "pack_floor_ratio": pack.get("floor_ratio"),
               "send_ms": 1e3 * (send.get("cpu") or {}).get("p50_seconds", float("nan")),
               "send_gpu_ms": 1e3 * ((send.get("gpu") or {}).get("p50_seconds") or float("nan")),
               "send_bytes_per_s": send.get("bandwidth_bytes_per_s"),
               "drafter_fwd_bwd_ms": 1e3 * ((span(d_end, "drafter.fwd_bwd").get("gpu") or {})
                                            .get("mean_seconds") or float("nan"))}
        if name == "host":
            d2h = span(t_end, "d2h_copy")
            row["d2h_floor_ratio"] = d2h.get("floor_ratio")
            row["d2h_bytes_per_s"] = d2h.get("bandwidth_bytes_per_s")
        rows.append(row)
    noprof = throughput(runs["nccl_noprof"]) if "nccl_noprof" in runs else float("nan")
    summary = {"rows": rows, "nccl_peer": peer, "payload_bytes": payload_bytes,
               "tokens_per_s_profile_off": noprof,
               "profile_overhead": 1 - rows[0]["drafter_meter_tokens_per_s"] / noprof}
    print("\n| run | tokens/s | target busy | pack ms (floor ratio) | send ms | send GB/s (peer GB/s) | drafter fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['tokens_per_s']:,.0f} | {r['target_busy_share']:.1%} | {r['pack_ms']:.2f} "
              f"({r['pack_floor_ratio'] or float('nan'):.2f}) | {r['send_ms']:.2f} | "
              f"{(r['send_bytes_per_s'] or 0) / 1e9:.1f} ({peer['nccl_bytes_per_s'] / 1e9:.1f} nccl, "
              f"{peer['pinned_bytes_per_s'] / 1e9:.1f} pinned) | {r['drafter_fwd_bwd_ms']:.1f} |")
    host = rows[-1]
    print(f"host d2h_copy: {(host.get('d2h_bytes_per_s') or 0) / 1e9:.1f} GB/s = "
          f"{host.get('d2h_floor_ratio') or float('nan'):.2f} of the measured pinned floor")
    print(f"profiling on vs off (nccl, drafter meter): {rows[0]['drafter_meter_tokens_per_s']:,.0f} vs {noprof:,.0f} tokens/s "
          f"({summary['profile_overhead']:+.2%})")
    print(f"payload {payload_bytes / 1e6:.0f} MB; bare NCCL send/recv {peer['nccl_seconds'] * 1e3:.2f} ms")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_pipeline.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
