"""How long a stop takes: SIGTERM to a real `dflash-train` at a chosen moment, timed to the launcher's exit, with
what the stop line said. Moments: `step` (training under way: the first interval written), `long-step` (2 s into
a step made 8 s long by DFLASH_FAULT slow=8@drafter.fwd_bwd:step=3), `eval` (1 s after the last step's
checkpoint, the evaluation under way). Arguments after `--` go to dflash-train.

    python3 bench/bench_stop.py --moment long-step --repeats 3 -- --device cpu --builtin-conversations 48
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import common


def once(moment: str, extra: list, work: Path) -> dict:
    """One run stopped by SIGTERM at `moment`: its exit status, the seconds to exit, the step its line named."""
    run = work / f"run-{time.time_ns()}"
    steps = {"step": "100000", "long-step": "8", "eval": "4"}[moment]
    args = ["--max-steps", steps, "--metrics-port", "0", "--profile-interval", "1"]
    if moment == "eval":
        args += ["--eval-prompts", "16", "--eval-new-tokens", "160"]
    env = {"DFLASH_FAULT": "slow=8@drafter.fwd_bwd:step=3"} if moment == "long-step" else {}
    err = work / f"{run.name}.err"
    p = common.train(run, [*args, *extra], env=env, wait=False, stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    checkpoints = lambda: common.records(run, 0, "event", "checkpoint")   # noqa: E731
    ready = {"step": lambda: common.records(run, 0, "interval"),
             "long-step": lambda: "injected slow=8" in err.read_text(),
             "eval": lambda: any(e.get("step") == int(steps) for e in checkpoints())}[moment]
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
    parser = common.parser(__doc__)
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
