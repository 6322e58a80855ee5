"""The TensorBoard and W&B sinks on a real GPU run, read back by their own readers against the run log.

    WANDB_MODE=offline python3 bench/gpu/sinks_check.py [--out DIR] [--steps 60]

A built-in GPU run with `--sinks tensorboard,wandb`; then, for rank 0 (the drafter), TensorBoard's EventAccumulator
and `wandb leet inspect --json` (wandb's reader of its offline run file) each give the tags the run logged, and
the interval scalars the issue names (tokens/s, MFU against the datasheet peak, model FLOP/s, the loss) are
compared with the drafter's interval records at the same steps. Exits 1 on a missing tag or a value that differs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from profiler import read_records  # noqa: E402
from profiler.schema.windows import mfu  # noqa: E402

TAGS = {"interval/tokens_rate": lambda r, peaks: r["counters"]["tokens"]["per_second"],
        "interval/model_flops_rate": lambda r, peaks: r["counters"]["model_flops"]["per_second"],
        "interval/mfu/datasheet": lambda r, peaks: mfu(r["counters"]["model_flops"]["per_second"], peaks)["datasheet"],
        "interval/train_loss": lambda r, peaks: r["metrics"]["loss"]["mean"]}


def logged(run: Path) -> tuple[list, dict]:
    """(the drafter's interval records, its run_start's compute peaks) from rank 0's log."""
    recs, _ = read_records(run / "profile" / "rank0.jsonl")
    start = next(r for r in recs if r.get("type") == "run_start")
    return [r for r in recs if r.get("type") == "interval"], start.get("compute_peaks") or {}


def tensorboard_scalars(run: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard" / "rank0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_scalars(run: Path) -> dict:
    found = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    rank0 = [f for f in found if "rank0" in f.read_bytes()[:1 << 20].decode("latin-1")] or found
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(rank0[0])],
                         capture_output=True, text=True, check=True).stdout
    series: dict = {}
    for line in out.splitlines():   # {"type": "history", "history": {"step": {"num": N}, "item": {key: value}}}
        rec = json.loads(line)
        if rec.get("type") != "history":
            continue
        body = rec["history"]
        for key, value in body["item"].items():
            if isinstance(value, (int, float)):
                series.setdefault(key, {})[int(body["step"]["num"])] = float(value)
    return series


def _value(want, rec: dict, peaks: dict) -> float | None:
    """The run log's figure for one tag, or None where the interval holds none (no tokens in a final interval)."""
    try:
        return want(rec, peaks)
    except (KeyError, TypeError):
        return None


def compare(name: str, series: dict, intervals: list, peaks: dict) -> bool:
    ok = True
    for tag, want in TAGS.items():
        got = series.get(tag, {})
        last = {r.get("step"): r for r in intervals}   # two intervals at one step: each sink keeps the later
        pairs = [(step, w, got.get(step)) for step, r in last.items()
                 if step in got and (w := _value(want, r, peaks)) is not None]
        bad = [p for p in pairs if p[2] is None or not math.isclose(p[1], p[2], rel_tol=1e-5)]
        print(f"{name:<12}{tag:<30}{len(got):>4} points; {len(pairs)} at an interval's step, {len(bad)} differ"
              + (f"; e.g. step {pairs[-1][0]}: {pairs[-1][2]:.6g} (run log {pairs[-1][1]:.6g})" if pairs else ""))
        ok &= bool(pairs) and not bad
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sinks-check"))
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    run = Path(a.out) / "sinks-run"
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--metrics-port", "0",
                           "--sinks", "tensorboard,wandb", "--profile-interval", "2", "--eval-prompts", "0",
                           "--max-steps", str(a.steps)], cwd=REPO, env=env, capture_output=True, text=True)
    print(done.stdout[-1500:], done.stderr[-1500:])
    if done.returncode != 0:
        return 1
    intervals, peaks = logged(run)
    ok = compare("TensorBoard", tensorboard_scalars(run), intervals, peaks)
    ok &= compare("W&B", wandb_scalars(run), intervals, peaks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
