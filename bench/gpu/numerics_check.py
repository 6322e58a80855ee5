"""The numerics early warning on a GPU (issue #49): injected drifts and a diverging learning rate warned of at least
LEAD_STEPS before the first non-finite value, healthy runs quiet. Each case is a real dflash-train run (the built-in
target, every other setting its default, --device cuda); the table gives, per run, the first `numerics_drift`
event (step, stage, rule, projected steps to overflow), the first `nonfinite` event's step and the lead between.

    python3 bench/gpu/numerics_check.py [--out DIR] [--healthy 3] [--device cuda|cpu]

Cases: drift@target.pack_hidden:step=20,factor=4 at --profile-interval 2 and at the default 60;
drift@drafter.fwd_bwd:step=20,factor=4; --lr DIVERGING_LR; --healthy seeds with no fault. `--device cpu` runs the
same on the CPU (small settings: a check of this script). Exits 1 when a faulty run has no warning on its stage
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


def cases(healthy: int) -> list:
    """(name, extra args, DFLASH_FAULT, the stage a warning must name or None for a healthy run)."""
    drift = "step=20,factor=4"
    out = [("drift target interval 2", ["--profile-interval", "2"], f"drift@target.pack_hidden:{drift}",
            "target.pack_hidden"),
           ("drift target interval 60", [], f"drift@target.pack_hidden:{drift}", "target.pack_hidden"),
           ("drift drafter", ["--profile-interval", "2"], f"drift@drafter.fwd_bwd:{drift}", "drafter.fwd_bwd"),
           ("lr diverges", ["--profile-interval", "2", "--lr", DIVERGING_LR], "", "")]
    return out + [(f"healthy seed {s}", ["--seed", str(s)], "", None) for s in range(healthy)]


def judge(run: Path, stage: str | None) -> tuple[bool, str]:
    """(ok, the row's text) of one finished run."""
    warned = sorted(events(run, "numerics_drift"), key=lambda e: e.step)
    bad = sorted(e.step for e in events(run, "nonfinite"))
    first_bad = bad[0] if bad else None
    if stage is None:
        return not warned, f"{len(warned)} warning(s), first non-finite {first_bad}"
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
    args = p.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="numerics_check_", dir=os.environ.get("OUT") or None))
    root.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, extra, fault, stage in cases(args.healthy):
        run = root / name.replace(" ", "_")
        small = CPU_SMALL if args.device == "cpu" else []
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--device", args.device,
                               "--metrics-port", "0", *small, *extra], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, DFLASH_FAULT=fault))
        ok, text = judge(run, stage)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:<26} rc {done.returncode} {time.monotonic() - t0:6.1f} s  {text}",
              flush=True)
    print(f"{failed} failed; runs under {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
