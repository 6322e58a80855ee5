"""How long a stop takes: SIGTERM to a real `dflash-train` at a chosen moment, timed to the launcher's exit, with
what the stop line said. Moments: `step` (training under way: the first interval written), `long-step` (2 s into
a step made 8 s long by DFLASH_FAULT slow=8@drafter.fwd_bwd:step=3), `eval` (1 s after the last step's
checkpoint, the evaluation under way). Arguments after `--` go to dflash-train.

    python3 bench/bench_stop.py --moment long-step --repeats 3 -- --device cpu --builtin-conversations 48
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from profiler.records import read_records

REPO = Path(__file__).resolve().parents[1]


def _events(run: Path, kind: str | None = None, rtype: str = "event") -> list:
    log = run / "profile" / "rank0.jsonl"
    recs = read_records(log)[0] if log.is_file() else []
    return [r for r in recs if r.get("type") == rtype and (kind is None or r.get("kind") == kind)]


def once(moment: str, extra: list, work: Path) -> dict:
    run = work / f"run-{time.time_ns()}"
    steps = {"step": "100000", "long-step": "8", "eval": "4"}[moment]
    args = ["--run-dir", str(run), "--max-steps", steps, "--metrics-port", "0", "--profile-interval", "1"]
    if moment == "eval":
        args += ["--eval-prompts", "16", "--eval-new-tokens", "160"]
    env = dict(os.environ, **({"DFLASH_FAULT": "slow=8@drafter.fwd_bwd:step=3"} if moment == "long-step" else {}))
    err = work / f"{run.name}.err"
    p = subprocess.Popen([sys.executable, "-m", "dflash.cli", *args, *extra], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    ready = {"step": lambda: _events(run, rtype="interval"),
             "long-step": lambda: "injected slow=8" in err.read_text(),
             "eval": lambda: any(e.get("step") == int(steps) for e in _events(run, "checkpoint"))}[moment]
    while not ready():
        if p.poll() is not None:
            raise SystemExit(f"the run ended before the moment: {err.read_text()[-2000:]}")
        time.sleep(0.1)
    time.sleep({"step": 0.0, "long-step": 2.0, "eval": 1.0}[moment])
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=300)
    took_s = time.monotonic() - t0
    said = re.search(r"stopped by SIGTERM at step (\d+)", err.read_text())
    return {"exit": code, "seconds": round(took_s, 2), "step": int(said.group(1)) if said else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moment", choices=("step", "long-step", "eval"), default="step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    extra = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    with tempfile.TemporaryDirectory() as work:
        results = [once(a.moment, extra, Path(work)) for _ in range(a.repeats)]
    for r in results:
        print(r)
    seconds = [r["seconds"] for r in results]
    print(f"{a.moment}: SIGTERM to exit, median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s "
          f"over {len(seconds)} runs; exit codes {sorted({r['exit'] for r in results})}")


if __name__ == "__main__":
    main()
