"""The exporters against real components, over the session's healthy run (tests/conftest.py: the
README default run, two ranks on CPU, watched live):

- a real Prometheus (Debian's package) scrapes both ranks through the run's file_sd targets, evaluating the
  shipped recording rules and alerts (at tests/conftest.py's ALERT_TIME_SCALE), and every panel query of the
  shipped Grafana dashboard (variables at their defaults) returns data from it, the host panels included;
  every template variable's label_values query finds values; `promtool check metrics` passes on a live scrape;
  no alert fired at any time of the healthy run;
- a real OTLP/HTTP receiver decodes the run's spans (catalog names, parent links, resource) and its span-time
  histogram, whose bucket bounds and counts are the run log's;
- the Perfetto trace of each rank and the merged trace hold every catalog span and matched flows.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from exporters.catalog import FAMILIES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# DFLASH_E2E_DEVICE=cuda runs the same checks on a GPU host, where the GPU panels must have data too.
DEVICE = os.environ.get("DFLASH_E2E_DEVICE", "cpu")
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "2", "--eval-new-tokens", "12",
         "--tokens-per-batch", "1024", "--max-length", "128", "--device", DEVICE]
CATALOG_SPANS = {"target.fetch", "target.fwd", "target.pack_hidden", "transfer.wait_slot", "transfer.send",
                 "drafter.recv", "drafter.fwd_bwd", "drafter.optim"}
# Families that only exist with a GPU (NVML and the CUDA allocator; the memory forecast rank 0 writes on CUDA): on
# CPU their panels are exempt; with DFLASH_E2E_DEVICE=cuda (the H200 run in bench/RESULTS.md) they must return data too.
GPU_FAMILIES = {f.name for f in FAMILIES.values() if "gpu" in f.labels or f.key.startswith("memory_forecast")
                } if DEVICE == "cpu" else set()
RATE_INTERVAL = "20s"
SCRAPED_S = 12.0   # seconds of both ranks scraped training, at least


def prom_get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture(scope="module")
def live(request):
    """The session's healthy run (tests/conftest.py), finished, as Prometheus and the receiver saw it."""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        pytest.skip("prometheus/promtool not installed (scripts/test.sh installs Debian's package as root)")
    healthy_run = request.getfixturevalue("healthy_run")
    assert healthy_run.returncode == 0, healthy_run.stderr[-3000:]
    run_id = json.loads((healthy_run.run / "config.json").read_text())["run_id"]   # the `run` label
    return {"base": healthy_run.prometheus, "run": healthy_run.run, "receiver": healthy_run.receiver,
            "scrapes": healthy_run.scrapes, "stdout": healthy_run.stdout, "port": healthy_run.port, "run_id": run_id,
            "sd_file": healthy_run.run.parent / "prometheus-sd" / f"{run_id}.json", "since": healthy_run.started_unix}


def both_ranks_times(base: str, since: float, query: str) -> list[float]:
    """Evaluation times (1 s apart) since `since` at which `query` counted both ranks."""
    data = prom_get(base, "/api/v1/query_range", query=query, start=since, end=time.time(), step="1s")
    return sorted(float(t) for series in data["result"] for t, v in series["values"] if float(v) == 2)


def shipped_dashboard() -> dict:
    """The committed dashboard (tests/exporters/test_dashboard.py proves it is the generator's output)."""
    return json.loads((REPO / "grafana" / "dflash.json").read_text())


def last_live_time(live: dict) -> float:
    """The newest evaluation time at which both ranks were training as the panels see it: both still scraped,
    each rank's spans advancing over the panels' rate window, and the recording rules holding both roles. A rank that has
    finished its work but is still scraped (the target ends before the drafter) is not live for a panel that
    divides by its rates."""
    query = ('count(dflash_step{job="dflash"}) == 2'
             f' and on () count(sum by (rank) (rate(dflash_spans_total{{job="dflash",clock="cpu"}}[{RATE_INTERVAL}])) > 0) == 2'
             ' and on () count(job_run_role:dflash_wait_seconds_per_profiled_seconds:ratio_rate10m{job="dflash"}) == 2')
    times = both_ranks_times(live["base"], live["since"], query)
    assert times, "Prometheus never saw both ranks training"
    return max(times)


def test_live_scrape_passes_promtool_and_carries_the_families(live):
    assert set(live["scrapes"]) == {0, 1}, "both ranks served /metrics while training"
    # Prometheus scraped both ranks training for SCRAPED_S at least: the rate windows below have data
    training = both_ranks_times(live["base"], live["since"], 'count(dflash_tokens_total{job="dflash"} > 0)')
    assert training and training[-1] - training[0] >= SCRAPED_S, training
    for rank, text in live["scrapes"].items():
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, (rank, r.stdout, r.stderr)
        assert 'dflash_build_info{' in text and 'dflash_events_total{' in text
        # every rank's own process series, labelled like its dflash_* ones
        assert re.search(rf'^process_cpu_seconds_total{{[^}}]*rank="{rank}"', text, flags=re.M), text[-2000:]
        assert "process_resident_memory_bytes{" in text
        assert "dflash_process_threads{" in text and "dflash_thread_cpu_seconds_total{" in text
    assert 'role="drafter"' in live["scrapes"][0] and 'dflash_train_loss{' in live["scrapes"][0]
    assert 'role="target"' in live["scrapes"][1] and 'span="target.fwd"' in live["scrapes"][1]


def test_targets_file_lists_every_rank_and_is_withdrawn_at_the_end(live):
    groups = json.loads((live["run"] / "prometheus" / "targets.json").read_text())
    assert groups == [{"targets": [f"127.0.0.1:{live['port']}", f"127.0.0.1:{live['port'] + 1}"],
                       "labels": {"run": live["run_id"], "run_dir": "run"}}]
    assert not live["sd_file"].exists()


def default_values(live: dict, at: float) -> dict:
    """The template variables at their defaults, as Grafana sets them on opening the dashboard: "All" (the
    allValue) for the label filters, the run picked, and for `clock` the first of its label_values options in
    the variable's sort order."""
    from tests.exporters.grafana_model import substitute_variables

    values = {"datasource": "prometheus", "job": ".+", "instance": ".+", "run": live["run_id"], "role": ".+", "rank": ".+",
              "gpu": ".+", "rate_interval": RATE_INTERVAL, "interval": "1s", "range": "60s"}
    clock = next(v for v in shipped_dashboard()["templating"]["list"] if v["name"] == "clock")
    selector = clock["query"][len("label_values("):-len(", clock)")]
    options = prom_get(live["base"], "/api/v1/label/clock/values",
                       **{"match[]": substitute_variables(selector, values)}, start=at - 60, end=at)
    assert options, clock["query"]
    values["clock"] = sorted(options, reverse=clock["sort"] == 2)[0]
    return values


def test_every_dashboard_panel_query_returns_data_from_prometheus(live):
    from tests.exporters.grafana_model import panel_queries, substitute_variables

    at = last_live_time(live)
    values = default_values(live, at)
    assert values["clock"] == ("gpu" if DEVICE == "cuda" else "cpu")   # follows the data: no gpu on a CPU run
    empty, gpu_only = [], []
    for title, ref, expr in panel_queries(shipped_dashboard()):
        if any(name in expr for name in GPU_FAMILIES):
            gpu_only.append(title)
            continue
        if title == "Firing alerts":   # empty on a healthy run (test below); test_alerts_e2e sees it fill
            continue
        data = prom_get(live["base"], "/api/v1/query", query=substitute_variables(expr, values), time=at)
        if not data["result"]:
            empty.append((title, ref, expr))
    assert not empty, f"panels with no data at t={at}: {empty}"
    # Only memory/GPU panels are exempt here; they need NVML and the CUDA allocator.
    assert all(any(k in t.lower() for k in ("gpu", "gpm", "memory", "headroom", "alloc", "oom", "retr", "throttle",
                                            "clock", "power", "temperat", "util")) for t in gpu_only), gpu_only


def test_every_template_variable_finds_values(live):
    from tests.exporters.grafana_model import substitute_variables

    at = last_live_time(live)
    values = {"datasource": "prometheus", "job": "dflash", "instance": ".+", "run": ".+", "role": ".+",
              "rank": ".+", "gpu": ".+"}
    checked = set()
    for var in shipped_dashboard()["templating"]["list"]:
        query = var.get("query")
        if var.get("type") != "query" or (var["name"] in ("gpu",) and DEVICE == "cpu"):
            continue
        q = query["query"] if isinstance(query, dict) else query
        assert q.startswith("label_values(") and q.endswith(")"), q
        selector, label = q[len("label_values("):-1].rsplit(",", 1)
        data = prom_get(live["base"], f"/api/v1/label/{label.strip()}/values",
                        **{"match[]": substitute_variables(selector.strip(), values)}, start=at - 60, end=at)
        assert data, f"variable {var['name']}: no values for {q}"
        checked.add(var["name"])
    assert {"job", "run", "instance", "role", "rank", "clock"} <= checked


def first_firing(live: dict, labels: dict) -> float:
    """The first evaluation time at which the alert `labels` names fired for its rank."""
    series = prom_get(live["base"], "/api/v1/query_range", start=live["since"], end=time.time(), step="1s",
                      query=f'ALERTS{{alertname="{labels["alertname"]}",alertstate="firing",rank="{labels["rank"]}"}}')
    return min(float(ts) for s in series["result"] for ts, _ in s["values"])


def throughput_drop_in_the_log(live: dict, labels: dict) -> bool:
    """Whether the run log shows the drop a DFlashThroughputDrop firing claims. At ALERT_TIME_SCALE the rule
    compares the rate over 10 s with the one 60 s earlier and fires once that held for 15 s, so from the first
    firing time T the log's tokens/s over [T-25, T] must be under half (with a margin for Prometheus'
    extrapolation and 1 s scrapes: 0.6) of its tokens/s over [T-85, T-60]."""
    from tests.conftest import ALERT_TIME_SCALE
    from tests.integration.run_ticks import ticks, tokens_rate

    t = first_firing(live, labels)
    window_s, offset_s, for_s = 600 * ALERT_TIME_SCALE, 3600 * ALERT_TIME_SCALE, 900 * ALERT_TIME_SCALE
    tks = ticks(live["run"], int(labels["rank"]))
    now = tokens_rate(tks, t - for_s - window_s, t)
    before = tokens_rate(tks, t - offset_s - for_s - window_s, t - offset_s)
    return now < 0.6 * before


def waits_in_the_log(live: dict, labels: dict) -> bool:
    """Whether the run log shows the wait a DFlashTargetBlocked or DFlashDrafterStarved firing claims: its rank's
    wait spans (dflash.pipeline.wait_spans) over 90% of its time for its 10 s window (at ALERT_TIME_SCALE) and the
    2 s `for:`; from the first firing time T, the log's wait share over [T-12, T] must be over 0.8 (a margin for
    1 s scrapes)."""
    from dflash import pipeline
    from tests.conftest import ALERT_TIME_SCALE
    from tests.integration.run_ticks import span_seconds_at, ticks

    t = first_firing(live, labels)
    tks = ticks(live["run"], int(labels["rank"]))
    waits = [span for span, role in pipeline.wait_spans().items() if role == labels["role"]]
    t0 = max(t - (600 + 120) * ALERT_TIME_SCALE, tks[0]["time_unix"])
    t1 = min(t, tks[-1]["time_unix"])
    waited = sum(span_seconds_at(tks, w, t1) - span_seconds_at(tks, w, t0) for w in waits)
    return t1 > t0 and waited / (t1 - t0) > 0.8


LOAD_ALERTS = {"DFlashThroughputDrop": throughput_drop_in_the_log, "DFlashTargetBlocked": waits_in_the_log,
               "DFlashDrafterStarved": waits_in_the_log}
"""The alerts a healthy run can truly earn here: it trains beside the rest of the suite, whose tests take the
CPU in turns, so its rate can halve for a while, and one role can wait on the other nearly all the time. Such a
firing passes only where the run log shows what the alert says."""


def test_the_healthy_run_raised_no_alert_while_the_rules_evaluated(live):
    """The shipped alerts, scaled to the test's seconds (tests/conftest.py ALERT_TIME_SCALE), evaluated every second
    over the whole run: none fired (pending ones, still inside their `for:` window, raise nothing). The recording
    rules did evaluate: the role wait ratio exists for both roles."""
    from exporters.rules import ROLE_WAIT_RATIO

    window = f"{int(time.time() - live['since']) + 5}s"
    fired = prom_get(live["base"], "/api/v1/query", query=f'count_over_time(ALERTS{{alertstate="firing"}}[{window}])')
    unjustified = [r["metric"] for r in fired["result"]
                   if r["metric"]["alertname"] not in LOAD_ALERTS
                   or not LOAD_ALERTS[r["metric"]["alertname"]](live, r["metric"])]
    assert unjustified == [], unjustified
    rules_health = prom_get(live["base"], "/api/v1/rules")
    assert all(rule["health"] == "ok" for group in rules_health["groups"] for rule in group["rules"]), rules_health
    roles = prom_get(live["base"], "/api/v1/query", query=f'count by (role) (count_over_time({ROLE_WAIT_RATIO}[{window}]))')
    assert {r["metric"]["role"] for r in roles["result"]} == {"target", "drafter"}


def test_otlp_receiver_gets_catalog_spans_with_parents_and_resource(live):
    spans = live["receiver"].spans()
    names = {s.name for _, s in spans}
    assert CATALOG_SPANS <= names, CATALOG_SPANS - names
    ids = {s.span_id for _, s in spans}
    children = [s for _, s in spans if s.parent_span_id]
    assert children and all(s.parent_span_id in ids for s in children)
    roles = {attrs["dflash.role"].string_value for attrs, _ in spans}
    assert roles == {"target", "drafter"}
    assert {attrs["dflash.run_id"].string_value for attrs, _ in spans} == {live["run_id"]}
    assert all(s.end_time_unix_nano >= s.start_time_unix_nano > 1.7e18 for _, s in spans)


def test_otlp_receiver_decodes_the_span_time_histogram_with_the_run_logs_bounds_and_counts(live):
    """The last `dflash.span.duration` point each rank exported (cumulative) holds, for every span and clock, the
    run log's bucket bounds and the sum of its intervals' bucket counts."""
    from profiler.runlog import read_records

    last: dict = {}
    for request in live["receiver"].metrics:
        for rm in request.resource_metrics:
            rank = next(a.value.int_value for a in rm.resource.attributes if a.key == "dflash.rank")
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == "dflash.span.duration":
                        assert metric.unit == "s" and metric.WhichOneof("data") == "histogram"
                        for point in metric.histogram.data_points:
                            attrs = {a.key: a.value.string_value for a in point.attributes}
                            last[rank, attrs["span"], attrs["clock"]] = point
    assert {rank for rank, *_ in last} == {0, 1}
    for rank in (0, 1):
        records, _ = read_records(live["run"] / "profile" / f"rank{rank}.jsonl")
        (start,) = [r for r in records if r["type"] == "run_start"]
        counts: dict = {}
        for interval in (r for r in records if r["type"] == "interval"):
            for span, entry in interval["spans"].items():
                buckets = (entry.get("cpu") or {}).get("buckets")
                if buckets and sum(buckets):
                    counts[span] = [a + b for a, b in zip(counts.get(span, [0] * len(buckets)), buckets)]
        assert "drafter.fwd_bwd" in counts or "target.fwd" in counts
        for span, expected in counts.items():
            point = last[rank, span, "cpu"]
            assert list(point.explicit_bounds) == start["histogram_buckets_seconds"], span
            assert list(point.bucket_counts) == expected and point.count == sum(expected), (rank, span)


def test_trace_files_and_merged_trace_hold_every_span_and_matched_flows(live, tmp_path):
    for rank in (0, 1):
        doc = json.loads((live["run"] / "trace" / f"rank{rank}.json").read_text())
        assert any(e.get("ph") == "X" for e in doc["traceEvents"])
    out = tmp_path / "merged.json"
    r = subprocess.run([sys.executable, "-m", "dflash.report_cli", "trace", str(live["run"]), "-o", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    events, meta = doc["traceEvents"], doc["metadata"]
    assert CATALOG_SPANS <= {e["name"] for e in events if e.get("ph") == "X"}
    starts = {e["id"] for e in events if e.get("ph") == "s"}
    ends = {e["id"] for e in events if e.get("ph") == "f"}
    assert starts and starts == ends
    # The target's and the drafter's detail windows hold the same batches: >= 95% of the sends have their receive.
    assert meta["flow_sends"] >= 10 and meta["flows_matched"] >= 0.95 * meta["flow_sends"], meta
    assert f"flows {meta['flows_matched']} matched / {meta['flows_unmatched']} unmatched" in r.stdout
    for rank, ph in ((0, "f"), (1, "s")):   # each rank's own file carries its halves
        doc = json.loads((live["run"] / "trace" / f"rank{rank}.json").read_text())
        assert len([e for e in doc["traceEvents"] if e.get("ph") == ph]) >= meta["flows_matched"]


def test_a_requested_metrics_port_in_use_is_one_line_and_exit_2_before_any_rank(tmp_path, train_main):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = train_main(["--run-dir", tmp_path / "run", "--metrics-port", port, *SMALL])
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"--metrics-port {port}: port {port} on 127.0.0.1" in lines[0] and "in use" in lines[0]
    assert not (tmp_path / "run").exists()


def test_shared_targets_directory_is_readable_by_another_user_and_the_run_stays_private(live):
    sd_dir = live["sd_file"].parent
    assert sd_dir.stat().st_mode & 0o777 == 0o755
    assert (live["run"] / "prometheus" / "targets.json").stat().st_mode & 0o777 == 0o600


def test_a_metrics_host_that_cannot_be_bound_is_one_line_and_exit_2(tmp_path, train_main):
    r = train_main(["--run-dir", tmp_path / "run", "--metrics-host", "192.0.2.1", *SMALL])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--metrics-host 192.0.2.1: cannot serve metrics there" in lines[0]
    assert not (tmp_path / "run").exists()
