"""Time to step 2 of dflash-train, first with a fresh compile cache, then restarted on the warm one.

    python3 bench/bench_compile.py [--out DIR] [--keep-cache DIR] [-- DFLASH-TRAIN ARGS...]

Runs `python -m dflash.cli` twice with the same `--compile-cache-dir` (a new directory under --out,
or --keep-cache), each in a run directory of its own, with `--max-steps 3 --eval-prompts 0
--profile-detail-steps 3` and whatever follows `--` (default: the built-in tiny target, 64
conversations). From drafter rank 0's run log (`spans` record) it reads, per run:

    launch_to_step2_s   from starting the process to the end of the second drafter.optim
    start_to_step2_s    from the profiler's run_start (after imports, rendezvous and the built-in
                        corpus) to the same point
    first_batch_s       run_start to the end of the first drafter.recv (the target's start-up)
    compile_s, compiles drafter.compile spans: total seconds and how many (each one's trigger, frame,
                        compile id and seconds under `compile_spans`)
    fwd_bwd_s           drafter.fwd_bwd of steps 0, 1 and 2
    startup_s           the rank's `startup` event: seconds per phase from launch to run_start

The cold run is the first compile of this code on this machine (inductor and Triton caches empty; the
cache dir is fresh); the warm run is a new run on the warm cache (it builds its own built-ins); the
resume run is the restart the cache is for: `--resume` of the cold run's directory, 3 more steps, so
"step 2" is the second step after the restart. Prints one JSON object per run and a
table; writes bench_compile.json under $OUT when set. Standard library only (dflash-train does the work).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import common

FIXED = ["--max-steps", "3", "--eval-prompts", "0", "--profile-detail-steps", "3", "--profile-interval", "600"]
DEFAULT = ["--builtin-conversations", "64"]


def run_once(name: str, out: Path, cache: Path, extra: list[str], timeout_s: float) -> dict:
    """One dflash-train run; its timings from drafter rank 0's run log. `resume` continues the cold
    run's directory for 3 more steps (a real restart: built-ins and checkpoint reused)."""
    run_dir = out / ("cold" if name == "resume" else name)
    more = ["--resume", "--max-steps", "6"] if name == "resume" else []
    launched = time.time()
    r = common.train(run_dir, ["--compile-cache-dir", cache, *FIXED, *extra, *more], capture_output=True, text=True,
                     timeout=timeout_s)
    wall = time.time() - launched
    (out / f"{name}.log").write_text(r.stdout + r.stderr)
    row = {"run": name, "exit": r.returncode, "wall_s": round(wall, 2), "run_dir": str(run_dir)}
    if r.returncode != 0:
        return dict(row, error=(r.stderr.strip().splitlines() or ["?"])[-1])
    return dict(row, **timings(run_dir, launched))


def timings(run_dir: Path, launched: float) -> dict:
    """Seconds to step 2 and the compile spans, from drafter rank 0's run log (its last segment: a resumed
    run appends to the log it continues)."""
    records = common.records(run_dir)
    last = max(i for i, r in enumerate(records) if r["type"] == "run_start")
    records = records[last:]
    start = records[0]
    spans = sorted((s for r in records if r["type"] == "spans" for s in r["spans"]),
                   key=lambda s: s["start_unix_ns"])

    def named(name: str) -> list:
        return [s for s in spans if s["name"] == name]

    def seconds(s: dict) -> float:
        return (s["end_unix_ns"] - s["start_unix_ns"]) / 1e9

    optim, recv, compiles = named("drafter.optim"), named("drafter.recv"), named("drafter.compile")
    if len(optim) < 2:
        return {"error": f"{run_dir}: fewer than 2 drafter.optim spans in rank 0's detail window"}
    step2_unix = optim[1]["end_unix_ns"] / 1e9
    return {
        "launch_to_step2_s": round(step2_unix - launched, 2),
        "start_to_step2_s": round(step2_unix - start["time_unix"], 2),
        "first_batch_s": round(recv[0]["end_unix_ns"] / 1e9 - start["time_unix"], 2) if recv else None,
        "compile_s": round(sum(seconds(s) for s in compiles), 2),
        "compiles": len(compiles),
        "compile_spans": [dict(s.get("attrs") or {}, thread=s["thread"], seconds=round(seconds(s), 2))
                          for s in compiles],
        "fwd_bwd_s": [round(seconds(s), 2) for s in named("drafter.fwd_bwd")[:3]],
        "startup_s": next((r["phases_seconds"] for r in records
                           if r["type"] == "event" and r.get("kind") == "startup"), None),
    }


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temp dir)")
    ap.add_argument("--keep-cache", type=Path, default=None,
                    help="compile cache dir to use (default: a fresh one under --out, so the first run is cold)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then dflash-train arguments")
    args = ap.parse_args()
    extra = [a for a in args.extra if a != "--"] or DEFAULT
    out = (args.out or Path(tempfile.mkdtemp(prefix="bench_compile-"))).absolute()
    out.mkdir(parents=True, exist_ok=True)
    cache = (args.keep_cache or out / "compile-cache").absolute()
    rows = []
    for name in ("cold", "warm", "resume"):   # each row as it finishes: a timeout keeps the earlier ones
        rows.append(run_once(name, out, cache, extra, args.timeout_s))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'run':<6}{'exit':>5}{'launch->step2 s':>17}{'start->step2 s':>16}{'first batch s':>15}"
          f"{'compile s':>11}{'compiles':>10}  fwd_bwd s (steps 0-2)")
    for r in rows:
        print(f"{r['run']:<6}{r['exit']:>5}{r.get('launch_to_step2_s', '-'):>17}{r.get('start_to_step2_s', '-'):>16}"
              f"{str(r.get('first_batch_s', '-')):>15}{r.get('compile_s', '-'):>11}{r.get('compiles', '-'):>10}  "
              f"{r.get('fwd_bwd_s', r.get('error', ''))}")
    print("\nstart-up of drafter rank 0, launch to run_start (the `startup` event), s:")
    for r in rows:
        print(f"{r['run']:<6} " + ", ".join(f"{k} {v:.2f}" for k, v in (r.get("startup_s") or {}).items()))
    print(f"\nruns and logs: {out}; compile cache: {cache}")
    common.write_out("bench_compile.json", rows)
    return 0 if all(r["exit"] == 0 and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
