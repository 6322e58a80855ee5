"""`dflash-profile snapshot` wall time against a live, training dflash-train run on this machine (CPU).

    python3 bench/bench_snapshot.py [--repeats 20] [--native-repeats 3]

Starts a two-rank CPU run (the integration tests' small config, many steps), waits until it has
closed an interval, then times whole CLI invocations (interpreter start, imports, endpoint query,
py-spy, merge, keeping the snapshot, printing) for --pid of the target rank, --run-dir of the run and
--pid --native, plus the bare `py-spy dump` inside each (the snapshot's own `pyspy_seconds`) and a
bare `py-spy dump --nonblocking` (what the in-run sampler pays per sample). Goal: --pid without
--native under 1 s. Prints a Markdown table; writes JSON to $OUT/bench_snapshot.json when set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import REPO

PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))   # the venv's, unactivated

SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024",
         "--max-length", "128", "--profile-interval", "2", "--device", "cpu"]


def wait_for_training(run: Path, train: subprocess.Popen, deadline_s: float = 240) -> int:
    """The target rank's pid, once both ranks have closed an interval (training under way)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if train.poll() is not None:
            raise SystemExit(f"dflash-train exited ({train.returncode}); see {run.parent}/train.log")
        if all(common.records(run, rank, "interval") for rank in (0, 1)):
            return common.records(run, 1, "run_start")[0]["pid"]
        time.sleep(0.5)
    raise SystemExit("the run did not start training in time")


def time_cli(args: list[str], repeats: int) -> dict:
    """Wall seconds of whole `dflash-profile snapshot ... --json` runs, and py-spy's share of each."""
    wall, pyspy = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dflash.profile_cli", "snapshot", *args, "--json"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        wall.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"dflash-profile {' '.join(args)} failed: {done.stderr.strip()}")
        out = json.loads(done.stdout)
        pyspy += [s["pyspy_seconds"] for s in out.get("ranks", [out])]
    return {"wall_seconds": wall, "pyspy_seconds": pyspy}


def time_sampler_dump(pid: int, repeats: int) -> tuple[list, list]:
    """Seconds of each successful bare `py-spy dump --nonblocking`, and the failures: reading a running
    process's memory can catch it mid-update ("Failed to get stack traces"); the sampler counts those."""
    seconds, failures = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run([PY_SPY, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0:
            failures.append(done.stderr.strip())
            continue
        seconds.append(time.perf_counter() - start)
    return seconds, failures


def row(name: str, values: list) -> list:
    """A table row: the case, its count, and the median, p90 and max of `values` (seconds) in ms."""
    return [name, len(values), *(f"{1000 * x:.0f}" for x in (statistics.median(values), common.quantile(values, 0.9),
                                                               max(values)))]


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--native-repeats", type=int, default=3)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    run = Path(tempfile.mkdtemp(prefix="dflash-bench-snapshot-")) / "run"
    train = common.train(run, ["--max-steps", "100000", *SMALL], wait=False, stdout=open(run.parent / "train.log", "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pid = wait_for_training(run, train)
        results = {"pid": time_cli(["--pid", str(pid)], args.repeats),
                   "run_dir": time_cli(["--run-dir", str(run)], max(1, args.repeats // 2)),
                   "native": time_cli(["--pid", str(pid), "--native"], args.native_repeats),
                   "sampler_dump_seconds": time_sampler_dump(pid, args.repeats)}
    finally:
        os.killpg(train.pid, signal.SIGKILL)
        train.wait()
    rows = []
    for key, name in (("pid", "`snapshot --pid` (whole CLI)"), ("run_dir", "`snapshot --run-dir`, 2 ranks"),
                      ("native", "`snapshot --pid --native`")):
        rows += [row(name, results[key]["wall_seconds"]),
                 row(f"... its py-spy dump{' --native' if key == 'native' else ''}", results[key]["pyspy_seconds"])]
    seconds, failures = results["sampler_dump_seconds"]
    rows.append(row(f"`py-spy dump --nonblocking` (one in-run sample; {len(failures)} of {args.repeats} failed)",
                    seconds))
    print(common.table(["case", "n", "median ms", "p90 ms", "max ms"], rows))
    print(f"load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs (the run's two ranks included)")
    goal = statistics.median(results["pid"]["wall_seconds"]) < 1.0 and max(results["pid"]["wall_seconds"]) < 1.0
    print(f"goal (--pid without --native under 1 s, every run): {'met' if goal else 'MISSED'}")
    common.write_out("bench_snapshot.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
