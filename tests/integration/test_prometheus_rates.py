"""Live rates that are right at any scrape, and a run's end that reaches a Prometheus configured as shipped.

Two real short runs, each scraped by a real Prometheus (Debian's package):
- 4 s intervals and 1 s ticks, scraped every second (tests/conftest.py start_prometheus):
  `rate(dflash_tokens_total[W])`, evaluated through the HTTP API at unaligned times, agrees with the run log's
  ticks over the same window [t-W, t];
- the default intervals and ticks, scraped by grafana/prometheus.yml as shipped (5 s scrapes, 5 s file_sd refresh;
  only the targets path substituted, and no rule files or Alertmanager), stopped once it scraped both ranks: after
  the run exits it holds every rank's
  `dflash_run_end_timestamp_seconds` (alert DFlashRankFailed and the "Run end" panel read it) and final tokens.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from exporters.catalog import FAMILIES
from tests.conftest import free_port_pair, serve_prometheus, start_prometheus
from tests.integration.run_ticks import ticks, tokens_at

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
INTERVAL_S, TICK_S = 4.0, 1.0
ARGS = ["--max-steps", "60", "--profile-interval", str(INTERVAL_S), "--profile-tick-s", str(TICK_S),
        "--eval-prompts", "0", "--device", "cpu"]
TOKENS = FAMILIES["tokens"].name
RUN_END = FAMILIES["run_end"].name


def prom_get(base: str, path: str, **params) -> dict:
    with urllib.request.urlopen(f"{base}{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def start_shipped_prometheus(tmp: Path, sd_glob: Path) -> tuple[subprocess.Popen, str]:
    """grafana/prometheus.yml with its targets path made `sd_glob` (its rules and Alertmanager left out: neither
    is here), every timing as shipped."""
    config = yaml.safe_load((REPO / "grafana" / "prometheus.yml").read_text())
    config.pop("rule_files", None)
    config.pop("alerting", None)
    (job,) = config["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    sd["files"] = [str(sd_glob)]
    tmp.mkdir()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    return serve_prometheus(tmp / "prometheus.yml", tmp)


def train(run: Path, sd: Path, args: list) -> float:
    """A real run whose ranks Prometheus finds through `sd`; the Unix time it exited."""
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *args, "--metrics-port",
                           str(free_port_pair()), "--prometheus-sd-dir", str(sd)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return time.time()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """The run, finished, and the Prometheus that scraped it every second (still up)."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (Debian package prometheus)")
    tmp = tmp_path_factory.mktemp("rates")
    (tmp / "sd").mkdir()
    fast, fast_url = start_prometheus(tmp, tmp / "sd" / "*.json")
    try:
        train(tmp / "run", tmp / "sd", ARGS)
        time.sleep(2.0)   # the last 1 s scrape is in
        yield {"run": tmp / "run", "fast": fast_url}
    finally:
        fast.terminate()
        fast.wait(timeout=30)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A short run, finished, and the Prometheus running grafana/prometheus.yml that alone scraped it (a faster
    scraper beside it would answer the ranks' wait for a last scrape first)."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (Debian package prometheus)")
    tmp = tmp_path_factory.mktemp("shipped")
    (tmp / "sd").mkdir()
    proc, url = start_shipped_prometheus(tmp / "prometheus", tmp / "sd" / "*.json")
    try:
        train_until_scraped(tmp / "run", tmp / "sd", url)
        yield {"run": tmp / "run", "shipped": url}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def train_until_scraped(run: Path, sd: Path, base: str, ranks: int = 2) -> None:
    """A real run that Prometheus finds through `sd`, stopped by SIGTERM (a clean stop: run_end ok, exit 0) once
    Prometheus has scraped every rank: what is proven is that a scraped rank's end reaches it. A rank that ends
    before its first scrape (5 s file_sd refresh plus a 5 s scrape, longer on a loaded machine) is never in
    Prometheus at all, and does not wait for it (docs/RELIABILITY.md)."""
    args = ["--max-steps", "100000", "--eval-prompts", "0", "--device", "cpu"]
    with open(run.parent / "train.err", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *args, "--metrics-port",
                              str(free_port_pair()), "--prometheus-sd-dir", str(sd)],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 600
        while scraped_ranks(base) < ranks:
            assert p.poll() is None and time.monotonic() < deadline, (run.parent / "train.err").read_text()[-3000:]
            time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=300) == 0, (run.parent / "train.err").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()


def scraped_ranks(base: str) -> int:
    """How many of Prometheus' active dflash targets it has scraped, healthy."""
    targets = prom_get(base, "/api/v1/targets", state="active")["activeTargets"]
    return sum(t["health"] == "up" for t in targets if t["labels"].get("job") == "dflash")


def tick_tokens(tks: list, at: float, before: bool) -> float:
    """Tokens of the last tick at or before `at` (before=True), else of the first at or after it."""
    chosen = [t for t in tks if (t["time_unix"] <= at if before else t["time_unix"] >= at)]
    return (chosen[-1] if before else chosen[0])["counters"].get("tokens", 0)


def check_one(base: str, rank: int, tks: list, t: float, window_s: float) -> dict:
    """rate() at t against the run log: its raw samples are ticks (time and value); over the ticks they span it
    is the run log's rate; against the window [t-W, t] interpolated between ticks it is off by no more than what
    the ticks around the window's edges leave open (a step's tokens land at once, between two ticks)."""
    sel = f'{TOKENS}{{rank="{rank}"}}'
    raw = prom_get(base, "/api/v1/query", query=f"{sel}[{window_s:g}s]", time=f"{t:.3f}")["result"][0]["values"]
    for stamp, value in raw:   # every sample Prometheus holds is a tick: its value at its own time (to the ms)
        (tick,) = [k for k in tks if abs(k["time_unix"] - float(stamp)) < 0.0011]
        assert tick["counters"].get("tokens", 0) == float(value), (stamp, value, tick)
    got = float(prom_get(base, "/api/v1/query", query=f"rate({sel}[{window_s:g}s])", time=f"{t:.3f}")["result"][0]
                ["value"][1])
    (t0, c0), (t1, c1) = [(float(a), float(b)) for a, b in (raw[0], raw[-1])]
    ticks_rate, avg_s = (c1 - c0) / (t1 - t0), (t1 - t0) / (len(raw) - 1)
    edge_s = (t0 - (t - window_s), t - t1)
    want = (tokens_at(tks, t) - tokens_at(tks, t - window_s)) / window_s
    open_tokens = max(ticks_rate * sum(edge_s), (c0 - tick_tokens(tks, t - window_s, True))
                      + (tick_tokens(tks, t, False) - c1))
    return {"window_s": window_s, "t": t, "rate": got, "ticks_rate": ticks_rate, "interpolated": want,
            "open_tokens": open_tokens, "extrapolated_whole": max(edge_s) < 1.1 * avg_s}


def sampled_span(base: str, rank: int, tks: list) -> tuple[float, float]:
    """The times both the run log's training ticks and Prometheus' samples of the rank cover: the first and last
    tick that moved tokens (the final one left out), clipped to the first and last sample Prometheus holds."""
    busy = [t["time_unix"] for t in tks if t["counters"].get("tokens", 0) > 0 and not t.get("final")]
    whole_s = tks[-1]["time_unix"] - tks[0]["time_unix"] + 60
    (series,) = prom_get(base, "/api/v1/query", query=f'{TOKENS}{{rank="{rank}"}}[{whole_s:.0f}s]',
                         time=f"{tks[-1]['time_unix'] + 1:.3f}")["result"]
    stamps = [float(stamp) for stamp, _ in series["values"]]
    return max(busy[0], stamps[0]), min(busy[-1], stamps[-1])


def test_rate_at_unaligned_times_agrees_with_the_run_logs_ticks(scraped):
    run, base = scraped["run"], scraped["fast"]
    rank = next(r for r in (0, 1) if ticks(run, r)[0]["role"] == "drafter")
    tks = ticks(run, rank)
    first, last = sampled_span(base, rank, tks)
    assert last - first >= 4 * INTERVAL_S, (first, last)   # room for both windows, each at 8 times
    checked = []
    # every window and t lies inside the span (a quiet machine trains the run in less than 6 intervals' time);
    # whole seconds: a PromQL duration takes no fraction
    for window_s in (2 * INTERVAL_S, min(6 * INTERVAL_S, int(0.75 * (last - first)))):
        for k in range(8):   # spread over the training, off every tick, interval and scrape instant
            t = first + window_s + (last - first - window_s) * (k + 0.37) / 8
            checked.append(check_one(base, rank, tks, t, window_s))
    (run / "rates.json").write_text(json.dumps(checked, indent=1))   # the figures, for the record
    whole = [c for c in checked if c["extrapolated_whole"]]
    assert len(whole) >= len(checked) // 2, checked
    for c in whole:   # Prometheus extrapolated to both edges: the run log's rate over the ticks it holds
        assert c["rate"] == pytest.approx(c["ticks_rate"], rel=0.02), c
    for c in checked:
        assert abs(c["rate"] - c["interpolated"]) * c["window_s"] <= c["open_tokens"] + 0.02 * c["interpolated"] \
            * c["window_s"], c


def test_the_shipped_prometheus_holds_every_ranks_end_after_the_run_exits(shipped):
    run, base = shipped["run"], shipped["shipped"]
    ends = prom_get(base, "/api/v1/query", query=RUN_END, time=f"{time.time():.3f}")["result"]
    assert sorted(e["metric"]["rank"] for e in ends) == ["0", "1"], ends
    assert {e["metric"]["status"] for e in ends} == {"ok"}
    for e in ends:
        rank = int(e["metric"]["rank"])
        log = [json.loads(line) for line in (run / "profile" / f"rank{rank}.jsonl").read_text().splitlines()]
        (run_end,) = [r for r in log if r["type"] == "run_end"]
        assert float(e["value"][1]) == pytest.approx(run_end["time_unix"], abs=1e-3)
    tokens = prom_get(base, "/api/v1/query", query=TOKENS, time=f"{time.time():.3f}")["result"]
    final = {str(r): ticks(run, r)[-1]["counters"].get("tokens", 0) for r in (0, 1)}
    assert {t["metric"]["rank"]: float(t["value"][1]) for t in tokens} == final


def test_the_run_keeps_its_invariants(scraped):
    done = subprocess.run([sys.executable, "-m", "dflash.report_cli", "check", str(scraped["run"])],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rank_writes_a_tick_every_tick_s_and_one_at_each_close(scraped):
    for rank in (0, 1):
        lines = (scraped["run"] / "profile" / f"rank{rank}.jsonl").read_text().splitlines()
        log = [json.loads(line) for line in lines]
        tks, intervals = [r for r in log if r["type"] == "tick"], [r for r in log if r["type"] == "interval"]
        assert [t["index"] for t in tks] == list(range(len(tks))) and tks[-1].get("final") is True
        closes = {i["end_s"] for i in intervals}
        assert closes <= {t["t_s"] for t in tks}                     # one at each close, its instant
        grid = [t["t_s"] for t in tks if t["t_s"] not in closes]
        gaps = sorted(b - a for a, b in zip(grid, grid[1:]))
        assert gaps[len(gaps) // 2] == pytest.approx(TICK_S, abs=0.05), gaps   # the median gap: tick_s
        for a, b in zip(tks, tks[1:]):
            assert b["t_s"] >= a["t_s"]
            assert all(b["counters"].get(k, 0) >= v for k, v in a["counters"].items())
