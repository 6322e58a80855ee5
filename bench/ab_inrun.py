"""Profiling on vs off inside one live run (`dflash-profile overhead`), per workload, with a known cost as the peer.

    python3 bench/ab_inrun.py [--workload launch|gpu|both] [--inject-s 0,0.0002] [--pairs 30] [--phase-s 2]
                              [--settle-s 0.5] [--warm-steps 40] [--device auto|cuda|cpu] [--small]
                              [--builtin-conversations N] [--cpus auto] [--pin-ranks] [--workdir DIR]
                              [--compile-cache DIR] [--json FILE] [--deadline-s S]
                              [--after-first-interval]

Whole-run pairs (bench/ab_profile.py) spread +-10% and more on the H200's VM, whose vCPUs run 1.8x apart
and slow each other by up to 43% (bench/gpu/vcpu_pairs.py): a run's speed follows where its busy threads
land. Here each run stays where it landed and the comparison is made inside it: for each workload and
each injected cost S, one dflash-train run starts (bench/ab_profile.py's workloads, flags, compile cache,
CPU set and rank pinning; --max-steps far away), and once rank 0 has passed --warm-steps steps (compiled,
queues full) `dflash-profile overhead --run-dir RUN` alternates profiled and paused phases on it (ABBA,
rank 0's steps/s from the run's own step times, profiler/overhead.py); then the run is stopped.

The peer, measured in the same session: with S > 0 the run has DFLASH_FAULT="slow=S@target.fwd;
slow=S@drafter.optim", a sleep of S at the start of both sides' step, made only in profiled phases (faults
fire through spans). Whichever side bounds the run then takes S_real more per step, S_real being what
`time.sleep(S)` takes here (measured by this script), so a harness that measures truly reads
on/off - 1 = -S_real r / (1 + S_real r) on top of the profiler's own cost, r the paused phases' rate.
The table puts the measured difference, its interval and that expectation side by side.

Output: the table per workload on stdout, the machine line, and a JSON rewritten after every run
($OUT/ab_inrun.json when $OUT is set, else under the workdir), with each run's overhead result.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ab_profile as ab

REPO = ab.REPO
sys.path.insert(0, str(REPO))
from profiler.control import query   # noqa: E402
from profiler.snapshot import live_ranks   # noqa: E402

FAR_STEPS = "1000000"


def sleep_seconds(requested_s: float, n: int = 200) -> float:
    """The mean time `time.sleep(requested_s)` takes on this machine (0 for 0)."""
    if requested_s <= 0:
        return 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(requested_s)
    return (time.perf_counter() - t0) / n


def fault_for(inject_s: float) -> str | None:
    return f"slow={inject_s:g}@target.fwd;slow={inject_s:g}@drafter.optim" if inject_s > 0 else None


def start_run(setup: ab.Setup, run_dir: Path, args: list, inject_s: float):
    """The run, in its own process group, and its rank pinner (or None)."""
    env = dict(setup.env)
    fault = fault_for(inject_s)
    if fault:
        env["DFLASH_FAULT"] = fault
    out = run_dir.with_suffix(".log").open("w")
    proc = subprocess.Popen(ab.train_argv(setup, run_dir, args, "on"), stdout=out, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO, start_new_session=True)
    out.close()
    pinner = ab.RankPinner(proc.pid, setup.cpus) if setup.pin_ranks and setup.cpus else None
    return proc, pinner


def wait_for_steps(run_dir: Path, proc, steps: int, timeout_s: float) -> float:
    """Seconds from now until rank 0 has begun `steps` steps; RuntimeError when the run ends or stalls."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = run_dir.with_suffix(".log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {steps}:\n{tail}")
        ranks = live_ranks(run_dir)
        if ranks and ranks[0].get("rank") == 0 and query(ranks[0]["socket_path"], "progress").get("step", 0) >= steps:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"rank 0 did not reach step {steps} in {timeout_s:.0f} s")


def wait_for_interval(run_dir: Path, proc, timeout_s: float) -> float:
    """Seconds from now until rank 0 has closed its first interval (its run log holds an `interval` record):
    from then on its GPU sampler runs at its steady rate (until then it times every step: no step rate yet,
    profiler/cuda_timing.py GpuSampler); RuntimeError when the run ends or it does not come in time."""
    t0, log = time.monotonic(), run_dir / "profile" / "rank0.jsonl"
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before its first interval closed")
        if log.is_file() and '"type": "interval"' in log.read_text(errors="replace"):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"rank 0 closed no interval in {timeout_s:.0f} s")


def overhead(run_dir: Path, a: argparse.Namespace, env: dict, part: str = "all", max_s: float | None = None) -> dict:
    """`dflash-profile overhead --run-dir --part PART [--max-s]` on the live run: its JSON result, or
    {"error": ...}."""
    out = run_dir.with_suffix(f".overhead-{part}.json")
    argv = [sys.executable, "-m", "dflash.profile_cli", "overhead", "--run-dir", str(run_dir), "--pairs",
            str(a.pairs), "--phase-s", str(a.phase_s), "--settle-s", str(a.settle_s), "--part", part,
            "--out", str(out)] + ([] if max_s is None else ["--max-s", f"{max_s:.1f}"])
    r = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    print(r.stdout, end="", flush=True)
    if r.returncode != 0 or not out.is_file():
        return {"error": f"exit {r.returncode}: {r.stderr.strip()[-1500:]}"}
    return json.loads(out.read_text())


def spy_gil(run_dir: Path, seconds: float) -> dict:
    """Instead of the A/B: `py-spy record --gil --threads` on every rank for `seconds` (profiling on
    throughout): who holds the GIL, where. The raw files are RUN.rank{R}.gil.txt."""
    procs = {}
    for r in live_ranks(run_dir):
        out = run_dir.with_suffix(f".rank{r['rank']}.gil.txt")
        procs[r["rank"]] = subprocess.Popen(
            ["py-spy", "record", "--pid", str(r["pid"]), "--gil", "--threads", "--rate", "250", "--duration",
             f"{seconds:g}", "--format", "raw", "--nonblocking", "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return {"spy": {rank: (p.wait(), p.stderr.read()[-500:]) for rank, p in procs.items()},
            "error": "py-spy only (no A/B)"}


STOP_MARGIN_S = 20.0
"""What stopping a run and saving the JSON may take, kept out of the last measurement's time budget."""
RUN_START_S = 60.0
"""What starting and warming a later run may take (compile cache warm), kept for each run still to come."""


def budget_s(deadline_at: float | None, measurements_left: int, later_runs: int) -> float | None:
    """The time budget of the next measurement (`dflash-profile overhead --max-s`): an equal share of what is
    left before --deadline-s, less the stop margin and the later runs' starts; None without a deadline."""
    if deadline_at is None:
        return None
    left_s = deadline_at - time.monotonic() - STOP_MARGIN_S - RUN_START_S * later_runs
    return max(1.0, left_s / measurements_left)


def one_run(setup: ab.Setup, wl: ab.Workload, args: list, inject_s: float, a: argparse.Namespace,
            runs: Path, builtin: Path, later_runs: int = 0) -> list[dict]:
    """Start, warm up, measure in-run (each of --parts in turn, on the same run), stop; a record per part.
    Each measurement gets a share of the time left before --deadline-s (`later_runs` still to start after it)."""
    run_dir = runs / f"{wl.name}-inject{inject_s:g}"
    ab.seed_builtin(run_dir, builtin if wl.target_shape is None else None)
    proc, pinner = start_run(setup, run_dir, args, inject_s)
    rec = {"workload": wl.name, "inject_s": inject_s, "sleep_s": sleep_seconds(inject_s), "run_dir": str(run_dir)}
    out = []
    try:
        rec["warm_wait_s"] = wait_for_steps(run_dir, proc, a.warm_steps, a.run_timeout_s)
        if a.after_first_interval:
            rec["first_interval_wait_s"] = wait_for_interval(run_dir, proc, a.run_timeout_s)
        if a.spy_s:
            out.append({**rec, "part": "all", "result": spy_gil(run_dir, a.spy_s)})
        parts = [] if a.spy_s else a.parts
        for i, part in enumerate(parts):
            out.append({**rec, "part": part, "result": overhead(run_dir, a, setup.env, part,
                                                                 budget_s(a.deadline_at, len(parts) - i, later_runs))})
    except RuntimeError as exc:
        out.append({**rec, "part": "-", "result": {"error": str(exc)}})
    finally:
        ab._stop_group(proc)
        if pinner is not None:
            pinner.stop()
            for r in out:
                r["rank_cpus"] = pinner.pinned
    if wl.target_shape is None and not builtin.is_dir() and (run_dir / "builtin").is_dir():
        shutil.copytree(run_dir / "builtin", builtin)
    ab.tidy_run(run_dir, setup.keep_runs)
    return out


def expected_pct(rec: dict) -> float | None:
    """The injected cost's on/off - 1 in %, at the paused phases' rate (module doc)."""
    result = rec.get("result", {})
    if rec["inject_s"] <= 0 or "off" not in result or not result["off"]["mean"]:
        return None
    extra = rec["sleep_s"] * result["off"]["mean"]
    return -100.0 * extra / (1.0 + extra)


def format_rows(records: list[dict]) -> str:
    lines = ["| workload | injected | off pauses | pairs | off steps/s | on vs off | 95% CI | half-width | expected | "
             "resolves 1% | on within 1% |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        res = rec.get("result", {})
        inj = f"{1e6 * rec['inject_s']:.0f} us ({1e6 * rec['sleep_s']:.0f} real)" if rec["inject_s"] else "none"
        head = f"| {rec['workload']} | {inj} | {rec.get('part', 'all')} |"
        if "error" in res:
            lines.append(f"{head} FAILED: {res['error'].splitlines()[0][:150]} |")
            continue
        p, v, exp = res["paired"], res["verdicts"], expected_pct(rec)
        lines.append(f"{head} {res['pairs']} | {res['off']['mean']:.2f} | "
                     f"{p['mean_diff_pct']:+.2f}% | {p['ci_low_pct']:+.2f} .. {p['ci_high_pct']:+.2f}% | "
                     f"{p['half_width_pct']:.2f}% | {'-' if exp is None else f'{exp:+.2f}%'} | "
                     f"{'yes' if v['resolves'] else 'no'} | {v['within']} |")
    return "\n".join(lines)


def _injections(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds in [0, 1], got {text!r}")
    return values


def _parts(text: str) -> list[str]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or any(p not in ("all", "inline", "background", "gpu", "none") for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated all, inline, background, gpu, none; got {text!r}")
    return parts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("launch", "gpu", "both"), default="both")
    ap.add_argument("--inject-s", type=_injections, default=[0.0, 0.0002],
                    help="known costs per step to inject in profiled phases, one run each (0: none)")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--phase-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=0.5)
    ap.add_argument("--warm-steps", type=int, default=40, help="rank 0's steps before the first phase")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--small", action="store_true", help="CPU-sized workloads (a smoke test)")
    ap.add_argument("--builtin-conversations", type=int, default=None,
                    help="the launch workload's built-in corpus size (bench/gpu/ab.sh: 400)")
    ap.add_argument("--profile-interval", default="5")
    ap.add_argument("--extra", default="", help="more dflash-train arguments for the runs, one string "
                                                "(e.g. '--profile-gpu-steps-per-s 0')")
    ap.add_argument("--cpus", default="auto", help="taskset CPU list for every run, 'auto' or 'none'")
    ap.add_argument("--pin-ranks", action="store_true", help="one set of whole physical cores per rank")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dflash-ab"))
    ap.add_argument("--compile-cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/ab_inrun.json, else WORKDIR/ab_inrun.json")
    ap.add_argument("--run-timeout-s", type=float, default=300.0, help="longest wait for the warm steps")
    ap.add_argument("--parts", type=_parts, default=["all"],
                    help="what the off phases pause, one measurement each on the same run, in order: "
                         "comma-separated all, inline, background, gpu, none (dflash-profile overhead --part; "
                         "none: an A/A run)")
    ap.add_argument("--after-first-interval", action="store_true",
                    help="also wait for rank 0's first interval close: until then every step is GPU-timed")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="finish within this many seconds of starting: each measurement stops after the whole "
                         "pairs that fit in its share (dflash-profile overhead --max-s), its result kept")
    ap.add_argument("--spy-s", type=float, default=0.0,
                    help="no A/B: record who holds the GIL on every rank (py-spy --gil) for this long")
    a = ap.parse_args(argv)
    if a.pairs < 2 or a.phase_s <= 0 or a.settle_s < 0 or a.warm_steps < 1:
        ap.error("--pairs must be >= 2, --phase-s > 0, --settle-s >= 0 and --warm-steps >= 1")
    if a.deadline_s is not None and not a.deadline_s > 0:   # nan too: no run is started on a deadline already past
        ap.error(f"--deadline-s must be > 0 seconds, got {a.deadline_s:g}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.deadline_at = None if a.deadline_s is None else time.monotonic() + a.deadline_s
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # runs stop with us
    ab_argv = ["--workdir", str(a.workdir), "--device", a.device, "--profile-interval", a.profile_interval,
               "--cpus", a.cpus, f"--extra={a.extra}"] + (["--pin-ranks"] if a.pin_ranks else []) + \
              (["--compile-cache", str(a.compile_cache)] if a.compile_cache else [])
    setup, cache_note = ab.build_setup(ab.parse_args(ab_argv))
    json_path = a.json or (Path(os.environ["OUT"]) / "ab_inrun.json" if os.environ.get("OUT")
                           else setup.workdir / "ab_inrun.json")
    machine = ab.machine_info(setup.env)
    print(ab.format_machine(machine), f"\ncpus: {setup.cpus or 'not pinned'} | compile cache: {cache_note}", flush=True)
    report = ab.Report(json_path, {"machine": machine, "command": sys.argv, "cpus": setup.cpus, "runs": []})
    runs = setup.workdir / "inrun" / time.strftime("%Y%m%d-%H%M%S")
    runs.mkdir(parents=True)
    names = ("launch", "gpu") if a.workload == "both" else (a.workload,)
    later_runs = len(names) * len(a.inject_s)
    for name in names:
        wl = ab.make_workload(name, a.small, None, a.builtin_conversations)
        args = [*ab.prepare_workload(wl, setup.workdir, setup.env), *wl.flags, "--max-steps", FAR_STEPS]
        builtin = setup.workdir / ("builtin-" + "-".join(wl.flags or ["default"]).replace("--", ""))
        for inject_s in a.inject_s:
            later_runs -= 1
            report.data["runs"].extend(one_run(setup, wl, args, inject_s, a, runs, builtin, later_runs))
            report.save()
        print(f"== {name}\n" + format_rows([r for r in report.data["runs"] if r["workload"] == name]), flush=True)
    print(ab.format_machine(machine))
    ok = [r for r in report.data["runs"] if "error" not in r["result"]]
    print(f"in-run A/B: {len(ok)} of {len(report.data['runs'])} runs measured; mean phases per run "
          f"{statistics.fmean(len(r['result']['phases']) for r in ok) if ok else 0:.0f}; json: {json_path}")
    return 0 if len(ok) == len(report.data["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
