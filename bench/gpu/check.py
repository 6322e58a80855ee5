"""The GPU check to run before calling GPU work done: real runs on CUDA, every surface's figures side by side.

    python3 bench/gpu/check.py [--out DIR] [--only main|gpu-bound] [--steps-main 800] [--steps-bound 60]
                               [--capture-main 300] [--capture-bound 20]

Two runs of dflash-train on the GPU: the main job (the built-in target, target and drafter sharing the
GPU) and a GPU-bound one (a random Qwen3-8B-shaped target cut to 8 layers, long sequences). While each
trains, every rank's /metrics is scraped twice 10 s apart (mid-run); after it ends, `dflash-report check`
runs on its directory and the script prints, per run, each surface's drafter tokens/s with its window:
the throughput file, the run log's throughput event, `dflash-report hotspots --json`, the end-of-run line,
the interval records (steady intervals and the last one), the Prometheus counter's rate over the scrape
window and the progress line. Figures over the same window must agree within 1 %; the script prints the
spread of the steady-state ones and exits 1 when `check` failed or they disagree.

Each run also takes a Kineto capture of a few steps (`--capture-at-step`), which grades the always-on GPU
classification (profiler/gpu_lag.py, the hotspots JSON's `gpu_bound`): per rank and span with GPU work, the
capture's busy share (its kernels over our GPU window, `dflash-report kernels`) beside our class over the whole
run; a span the capture shows under 30% busy must be launch-bound, one above 70% must not be. A failure exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import profiler  # noqa: E402
from profiler import report    # noqa: E402
from profiler.schema.windows import is_steady  # noqa: E402

LAUNCH_BUSY_MAX, GPU_BUSY_MIN = 0.30, 0.70   # the grade: Kineto busy under this is launch-bound, above that is not
TOKENS_RE = re.compile(r'^dflash_tokens_total\{([^}]*)\} ([0-9.e+]+)$', re.M)


def free_port_pair() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            return port


def scrape(port: int, ranks: int) -> dict:
    """{rank: tokens counter} from each rank's /metrics."""
    out = {}
    for r in range(ranks):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port + r}/metrics", timeout=3).read().decode()
        except OSError:
            continue
        for labels, value in TOKENS_RE.findall(text):
            if 'role="drafter"' in labels:
                out[r] = float(value)
    return out


def intervals_logged(run_dir: Path) -> int:
    n = 0
    for path in (run_dir / "profile").glob("rank*.jsonl"):
        n = max(n, path.read_text(errors="replace").count('"type": "interval"'))
    return n


def train(run_dir: Path, args: list, after_intervals: int) -> dict:
    """One run; the Prometheus rate over 10 s once `after_intervals` intervals are logged."""
    port = free_port_pair()
    out = run_dir.with_suffix(".out")
    t0 = time.monotonic()
    with out.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run_dir), "--metrics-port",
                                 str(port), *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        prom = None
        while proc.poll() is None:
            if prom is None and (run_dir / "profile").is_dir() and intervals_logged(run_dir) >= after_intervals:
                a, ta = scrape(port, 2), time.monotonic()
                time.sleep(10.0)
                b, tb = scrape(port, 2), time.monotonic()
                prom = {"window": f"{tb - ta:.1f} s mid-run (Prometheus counter rate)",
                        "tokens_per_s": sum(b[r] - a[r] for r in b if r in a) / (tb - ta) if a and b else None}
            time.sleep(1.0)
    return {"rc": proc.returncode, "wall_s": time.monotonic() - t0, "stdout": out.read_text(), "prometheus": prom}


def figures(run_dir: Path, res: dict) -> list:
    """[(surface, window, drafter tokens/s)] of one finished run."""
    rows = []
    files = [json.loads(p.read_text()) for p in sorted((run_dir / "throughput").glob("rank*.json"))]
    drafter_files = [d for d in files if d.get("role") == "drafter"]
    rows.append(("throughput file", "steady state",
                 sum(d["steady_tokens_per_s"] for d in drafter_files) if drafter_files else None))
    events, intervals, phases = [], [], ()
    for path in sorted((run_dir / "profile").glob("rank*.jsonl")):
        recs, _ = profiler.read_records(path)
        if any(r.get("role") == "drafter" for r in recs[:1]):
            events += [r for r in recs if r.get("type") == "event" and r.get("kind") == "throughput"][-1:]
            intervals += [r for r in recs if r.get("type") == "interval"]
            phases = next((r["phase_spans"] for r in recs if r.get("type") == "run_start" and r.get("phase_spans")),
                          phases)
    rows.append(("run-log throughput event", "steady state",
                 sum(e["steady_tokens_per_s"] for e in events) if events else None))
    rep = report.hotspots(run_dir)
    rows.append(("dflash-report hotspots --json", "steady state", rep.get("steady_tokens_per_s")))
    m = re.search(r"drafter steady state: ([0-9,]+) tokens/s", res["stdout"])
    rows.append(("end-of-run line", "steady state", float(m.group(1).replace(",", "")) if m else None))
    steady = [r for r in intervals if is_steady(r, phases)]
    rates = [((r.get("counters") or {}).get("tokens") or {}).get("per_second") for r in steady]
    rates = [x for x in rates if x is not None]
    tokens = sum(((r.get("counters") or {}).get("tokens") or {}).get("total") or 0 for r in steady)
    wall = sum(r["duration_seconds"] for r in steady)
    rows.append(("interval records", f"{len(steady)} steady intervals (tokens over their wall)",
                 tokens / wall if wall else None))
    if rates:
        rows.append(("interval line", "last steady interval", rates[-1]))
        rows.append(("interval lines", f"median of {len(rates)} intervals", statistics.median(rates)))
    if res["prometheus"]:
        rows.append(("Prometheus", res["prometheus"]["window"], res["prometheus"]["tokens_per_s"]))
    prog = re.findall(r"([0-9,]+) tok/s \(last (\d+) s\)", res["stdout"])
    if prog:
        rows.append(("progress line", f"last {prog[-1][1]} s before it printed", float(prog[-1][0].replace(",", ""))))
    return rows


def grade_rows(kin: dict, hot: dict) -> list:
    """[(rank, role, span, Kineto busy share, our gpu_bound or None, verdict)] for every captured span with GPU
    work (report.kernels' `bound` set); verdict "FAIL" when a span under LAUNCH_BUSY_MAX busy is not launch-bound
    or one above GPU_BUSY_MIN is, else "ok"."""
    ours = {(r["role"], r["span"]): r.get("gpu_bound") for r in hot["spans"]["rows"]}
    rows = []
    for rk in kin["ranks"]:
        for s in rk["spans"]:
            if s["bound"] is None or s["outside_spans"] or s["busy_share"] is None:
                continue
            g = ours.get((rk["role"], s["name"]))
            cls = g["class"] if g else None
            bad = ((s["busy_share"] < LAUNCH_BUSY_MAX and cls != "launch-bound")
                   or (s["busy_share"] > GPU_BUSY_MIN and cls == "launch-bound"))
            rows.append((rk["rank"], rk["role"], s["name"], s["busy_share"], g, "FAIL" if bad else "ok"))
    return rows


def grade_classification(run_dir: Path) -> bool:
    """Print the capture-vs-always-on table (module doc); False when a span fails or there is nothing to grade."""
    try:
        kin, hot = report.kernels(run_dir), report.hotspots(run_dir)
    except report.ReportError as exc:
        print(f"   GPU classification: not graded: {exc}")
        return False
    rows = grade_rows(kin, hot)
    print(f"   GPU classification vs the capture ({kin['window']}; ours over the whole run):")
    print(f"   {'rank':>4} {'role':<8} {'span':<22} {'Kineto busy':>11} {'ours':<13} {'launch-bound':>12} "
          f"{'samples':>7} {'start lag':>10} {'end lag':>10}  grade")
    for rank, role, span, busy, g, verdict in rows:
        g = g or {}
        def lag(k, g=g):
            return "-" if g.get(k) is None else f"{g[k] * 1e6:.0f} us"
        share = "-" if g.get("launch_bound_share") is None else f"{g['launch_bound_share']:.0%}"
        print(f"   {rank:>4} {str(role):<8} {span:<22} {busy:>11.0%} {str(g.get('class')):<13} {share:>12} "
              f"{g.get('samples', 0):>7} {lag('start_lag_p50_s'):>10} {lag('end_lag_p50_s'):>10}  {verdict}")
    if (hot.get("split") or {}).get("topology", {}).get("ranks_share_gpus"):
        print("   (the ranks share a GPU: a span can wait on the other rank's kernels, time-sliced, which its own "
              "capture does not show; such a span is not launch-bound, though its capture reads idle)")
    failed = [r for r in rows if r[-1] == "FAIL"]
    print(f"   graded {len(rows)} spans: {len(failed)} failed (under {LAUNCH_BUSY_MAX:.0%} busy must be launch-bound, "
          f"over {GPU_BUSY_MIN:.0%} must not be)")
    return bool(rows) and not failed


def check_and_print(name: str, run_dir: Path, res: dict) -> bool:
    chk = subprocess.run([sys.executable, "-m", "dflash.report_cli", "check", str(run_dir)], cwd=REPO,
                         capture_output=True, text=True)
    rows = figures(run_dir, res)
    print(f"\n== {name}: rc {res['rc']}, {res['wall_s']:.0f} s, {run_dir}")
    print(f"   dflash-report check: exit {chk.returncode}")
    for line in (chk.stdout + chk.stderr).strip().splitlines()[:40]:
        print(f"     {line}")
    print(f"   {'surface':<30} {'window':<48} {'drafter tokens/s':>16}")
    for surface, window, value in rows:
        print(f"   {surface:<30} {window:<48} {'-' if value is None else f'{value:,.0f}':>16}")
    same = [v for s, w, v in rows if w == "steady state" and v is not None]
    spread = (max(same) - min(same)) / min(same) if len(same) > 1 and min(same) > 0 else None
    print(f"   steady-state surfaces: {len(same)}, spread {'-' if spread is None else f'{spread:.3%}'} (want <= 1%)")
    tail = [ln for ln in res["stdout"].splitlines() if ln.strip()][-14:]
    print("   end of the run's output:\n" + "\n".join("     " + ln for ln in tail))
    graded = grade_classification(run_dir)
    return (res["rc"] == 0 and chk.returncode == 0 and len(same) == 4 and spread is not None and spread <= 0.01
            and graded)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-check"))
    ap.add_argument("--only", choices=("main", "gpu-bound"), default=None)
    ap.add_argument("--steps-main", type=int, default=800)
    ap.add_argument("--steps-bound", type=int, default=60)
    ap.add_argument("--capture-main", type=int, default=300, help="the main job's captured step (3 steps)")
    ap.add_argument("--capture-bound", type=int, default=20, help="the GPU-bound job's captured step (3 steps)")
    a = ap.parse_args()
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    ok = True
    if a.only in (None, "main"):
        run = root / "main"
        res = train(run, ["--profile-interval", "10", "--max-steps", str(a.steps_main), "--capture-at-step",
                          str(a.capture_main), "--capture-steps", "3"], after_intervals=3)
        ok &= check_and_print("main job (built-in target, one GPU)", run, res)
    if a.only in (None, "gpu-bound"):
        target = Path("/tmp/qwen3-8b-shape-8l")
        if not (target / "config.json").is_file():
            subprocess.run([sys.executable, str(REPO / "bench/make_random_target.py"), "--out", str(target),
                            "--layers", "8"], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        data = root / "long.jsonl"
        sys.path.insert(0, str(REPO / "bench"))
        from bench_pipeline import make_long_corpus
        make_long_corpus(data, 200, words_per_turn=2048)
        run = root / "gpu-bound"
        res = train(run, ["--target-model", str(target), "--data", str(data), "--max-length", "2048",
                          "--tokens-per-batch", "4096", "--num-anchors", "256", "--eval-prompts", "0",
                          "--profile-interval", "5", "--max-steps", str(a.steps_bound), "--capture-at-step",
                          str(a.capture_bound), "--capture-steps", "3"], after_intervals=4)
        ok &= check_and_print("GPU-bound (Qwen3-8B-shaped target, 8 layers, 4096 tokens a batch)", run, res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
