"""The numerics early warning on a GPU (issue #49): injected drifts and a diverging learning rate warned of at least
LEAD_STEPS before the first non-finite value, healthy runs quiet. Each case is a real dflash-train run (the built-in
target, every other setting its default, --device cuda); the table gives, per run, the first `numerics_drift`
event (step, stage, rule, projected steps to overflow), the first `nonfinite` event's step and the lead between.

    python3 bench/gpu/numerics_check.py [--out DIR] [--healthy 3] [--device cuda|cpu] [--lr 3000,1e5] [--only WORDS]
                                        [--seed0 0] [--parallel N] [--default-settings]

Cases: drift@target.pack_hidden:step=20,factor=4 at --profile-interval 2 and at the default 60;
drift@drafter.fwd_bwd:step=20,factor=4; --lr DIVERGING_LR; --healthy seeds with no fault. `--device cpu` runs the
same on the CPU (small settings: a check of this script; `--default-settings` keeps the default run's settings
there too, for the issue's healthy default runs on the CPU). Exits 1 when a faulty run has no warning on its stage
LEAD_STEPS before its first non-finite value, or a healthy run warns.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from tests.integration.test_numerics_drift import events  # noqa: E402  (the test's reading of a run's events)

LEAD_STEPS = 5
DIVERGING_LR = "3000"   # tests/integration/test_numerics_drift.py's (on the CPU: warned at step 1, non-finite at 22)
CPU_SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128"]


def cases(healthy: int, lrs: list, seed0: int = 0) -> list:
    """(name, extra args, DFLASH_FAULT, the stage a warning must name or None for a healthy run)."""
    drift = "step=20,factor=4"
    out = [("drift target interval 2", ["--profile-interval", "2"], f"drift@target.pack_hidden:{drift}",
            "target.pack_hidden"),
           ("drift target interval 60", [], f"drift@target.pack_hidden:{drift}", "target.pack_hidden"),
           ("drift drafter", ["--profile-interval", "2"], f"drift@drafter.fwd_bwd:{drift}", "drafter.fwd_bwd"),
           *((f"lr {lr} diverges", ["--profile-interval", "2", "--lr", lr], "", "") for lr in lrs)]
    return out + [(f"healthy seed {s}", ["--seed", str(s)], "", None) for s in range(seed0, seed0 + healthy)]


def judge(run: Path, stage: str | None, rc: int = 0) -> tuple[bool, str]:
    """(ok, the row's text) of one finished run; a healthy run must also have exited 0 (a run that died before
    its steps is not quiet, it is not a run)."""
    warned = sorted(events(run, "numerics_drift"), key=lambda e: e.step)
    bad = sorted(e.step for e in events(run, "nonfinite"))
    first_bad = bad[0] if bad else None
    if stage is None:
        return not warned and rc == 0, f"{len(warned)} warning(s), first non-finite {first_bad}"
    named = [e for e in warned if not stage or e.span == stage]
    if not named or first_bad is None:
        return False, f"warnings {[(e.step, e.span, e.tensor) for e in warned]}, first non-finite {first_bad}"
    w = named[0]
    lead = first_bad - w.step
    return lead >= LEAD_STEPS, (f"warned step {w.step} {w.span} {w.tensor} {w.rule} x{w.growth_per_step or 0:.3g}/step "
                                f"~{w.steps_to_overflow} steps to overflow; first non-finite step {first_bad}; "
                                f"lead {lead} steps")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: $OUT or a temporary dir)")
    p.add_argument("--healthy", type=int, default=3, help="healthy seeds (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--lr", default=DIVERGING_LR, help="the diverging learning rates tried, comma-separated "
                   "(default: %(default)s)")
    p.add_argument("--only", default="", help="only the cases whose name holds one of these words, comma-separated")
    p.add_argument("--seed0", type=int, default=0, help="the first healthy seed (default: %(default)s)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (default: %(default)s; a run's steps are "
                   "what is judged, not its speed)")
    p.add_argument("--default-settings", action="store_true", help="on the CPU, the default run's settings rather "
                   "than the small ones")
    args = p.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="numerics_check_", dir=os.environ.get("OUT") or None))
    root.mkdir(parents=True, exist_ok=True)
    words = [w for w in args.only.split(",") if w]
    todo = [c for c in cases(args.healthy, [x for x in args.lr.split(",") if x], args.seed0)
            if not words or any(w in c[0] for w in words)]
    failed, running = 0, []
    for i, case in enumerate(todo):
        running.append(start(root, args.device, *case, small=args.device == "cpu" and not args.default_settings))
        while running and (len(running) >= args.parallel or i == len(todo) - 1):
            failed += finish(running.pop(0))
    print(f"{failed} failed; runs under {root}")
    return 1 if failed else 0


def start(root: Path, device: str, name: str, extra: list, fault: str, stage, small: bool = False) -> tuple:
    """One case's dflash-train started: (name, stage, run dir, process, start time); `small`: CPU_SMALL's settings."""
    run = root / name.replace(" ", "_")
    log = open(root / f"{run.name}.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--device", device,
                             "--metrics-port", "0", *(CPU_SMALL if small else []), *extra],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, DFLASH_FAULT=fault))
    log.close()
    return name, stage, run, proc, time.monotonic()


def finish(case: tuple) -> int:
    """Wait for one started case, print its row; 1 if it failed."""
    name, stage, run, proc, t0 = case
    rc = proc.wait()
    ok, text = judge(run, stage, rc)
    print(f"{'ok  ' if ok else 'FAIL'} {name:<26} rc {rc} {time.monotonic() - t0:6.1f} s  {text}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
