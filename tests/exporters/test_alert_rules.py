"""`promtool test rules` on the shipped rule file (grafana/dflash.rules.yml, its real windows): for every alert, series that make it fire (its labels and rendered annotations checked exactly), the
evaluation just before its `for:` window ends (not firing yet), and series of a healthy run on which it stays
quiet. Plus the recorded ratios: a role's share is its ranks' summed numerators over summed denominators."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash.pipeline import wait_spans
from exporters import rules

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
RUN = {"job": "dflash", "run": "r1", "instance": "127.0.0.1:9465", "rank": "1", "role": "target", "host": "h1"}
DRAFTER = {**RUN, "instance": "127.0.0.1:9464", "rank": "0", "role": "drafter"}
GPU = {"gpu": "0", "UUID": "GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12"}
FORECAST = {"setting": "--tokens-per-batch"}   # a memory forecast's setting (rank 0 writes the forecast)
BUILD = {"version": "0.1.0", "schema": "1", "torch_version": "2.13.0", "python_version": "3.11", "device_name": "cpu"}
RANK_LABELS = ("job", "run", "instance", "rank", "role")   # what the per-rank event alerts keep


def series(name: str, labels: dict, values: str) -> dict:
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def only(labels: dict, keys=RANK_LABELS) -> dict:
    return {k: labels[k] for k in keys}


def event(kind: str, values: str, labels=RUN) -> dict:
    return series("dflash_events_total", {**labels, "kind": kind}, values)


def wait(labels: dict, span: str, sum_values: str) -> list:
    """A rank's wait-span seconds (cumulative) beside its profiled seconds, 1 s per second."""
    return [series("dflash_span_time_seconds_total", {**labels, "span": span, "clock": "cpu"}, sum_values),
            series("dflash_profiled_seconds_total", labels, "0+60x40")]


# alert -> (firing input, the minute it fires, its labels besides severity, its description, healthy input).
# Each condition begins at a whole minute, so one minute before `fire` it is still pending in its `for:` window.
CASES = {
    "DFlashRankDown": (
        [series("up", only(RUN, ("job", "run", "instance")), "1 1 1 0x6"),
         series("dflash_build_info", {**RUN, **BUILD}, "1 1 1 stale")], 5, only(RUN),
        "Prometheus has not scraped rank 1 (target) of run r1 at 127.0.0.1:9465 for 2 minutes while the run's "
        "targets still list it: the rank's process is gone without having finished its run.",
        [series("up", only(RUN, ("job", "run", "instance")), "1x9"),
         series("dflash_build_info", {**RUN, **BUILD}, "1x9")]),
    "DFlashRankSilent": (
        [series("dflash_heartbeat_timestamp_seconds", RUN, "0+60x5 300x15"),
         series("dflash_profiled_seconds_total", RUN, "0+60x20"),
         series("dflash_profile_intervals_total", RUN, "0+1x20")], 13, only(RUN),
        "The last record of rank 1 (target) of run r1 is 8m 0s old, more than three of its profile intervals: "
        "its collector or exporter thread is stuck.",
        [series("dflash_heartbeat_timestamp_seconds", RUN, "0+60x5 300x15"),   # it finished its run
         series("dflash_run_end_timestamp_seconds", {**RUN, "status": "ok"}, "_x5 300x15"),
         series("dflash_profiled_seconds_total", RUN, "0+60x5 300x15"),
         series("dflash_profile_intervals_total", RUN, "0+1x5 5x15")]),
    "DFlashRankFailed": (
        [series("dflash_run_end_timestamp_seconds", {**RUN, "status": "hang"}, "_ _ 120 stale")], 3,
        {**RUN, "status": "hang"}, 'Rank 1 (target) of run r1 ended with status "hang".',
        [series("dflash_run_end_timestamp_seconds", {**RUN, "status": "ok"}, "_ _ 120 stale")]),
    "DFlashNonFiniteValue": (
        [event("nonfinite", "0 0 0 1x10")], 4, only(RUN),
        "Rank 1 (target) of run r1 found a NaN or Inf in the last 10 minutes; the run log's first nonfinite event "
        "names the span, step and tensor.",
        [event("nonfinite", "0x13")]),
    "DFlashOutOfMemory": (
        [event("oom", "0 0 0 1x10"), series("dflash_allocator_ooms_total", {**RUN, **GPU}, "0 0 0 1x10")], 4,
        only(RUN), "Rank 1 (target) of run r1 raised an out-of-memory error in the last 10 minutes.",
        [event("oom", "0x13"), series("dflash_allocator_ooms_total", {**RUN, **GPU}, "0x13")]),
    "DFlashThreadCrashed": (
        [event("thread_crash", "0 0 0 1x10")], 4, only(RUN),
        "A thread of rank 1 (target) of run r1 ended with an exception in the last 10 minutes; the rank stops.",
        [event("thread_crash", "0x13")]),
    "DFlashHang": (
        [event("hang", "0 0 0 1x10")], 4, only(RUN),
        "The hang watchdog of rank 1 (target) of run r1 saw no progress for its timeout, dumped every thread and "
        "stopped the rank.", [event("hang", "0x13"), event("signal", "0 0 0 1x10")]),
    "DFlashNumericsDrift": (
        [event("numerics_drift", "0 0 0 1x10", DRAFTER)], 4, only(DRAFTER),
        "Rank 0 (drafter) of run r1 warned of a numerics drift in the last 10 minutes: a stage's statistic grows "
        "geometrically, nears its dtype's range or its update ratio jumped, before any NaN or Inf; the run log's "
        "numerics_drift event names the span, tensor, trend and steps left to overflow.",
        [event("numerics_drift", "0x13", DRAFTER), event("nonfinite", "0 0 0 1x10", DRAFTER)]),
    "DFlashGpuMemoryHeadroomLow": (
        [series("dflash_gpu_memory_headroom_min_ratio", {**RUN, **GPU}, "0.2 0.2 0.04x10")], 7, {**RUN, **GPU},
        "GPU 0 (GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12) of rank 1 (target) of run r1 had its memory low point at "
        "4% of its size in each interval for 5 minutes.",
        [series("dflash_gpu_memory_headroom_min_ratio", {**RUN, **GPU}, "0.2 0.2 0.06x10")]),
    "DFlashGpuMemoryHeadroomExhausting": (   # falls 1 GB a minute from 80 GB: 60 GB an hour, below zero from 21m
        [series("dflash_gpu_memory_headroom_min_bytes", {**RUN, **GPU}, "80000000000-1000000000x60")], 36,
        {**RUN, **GPU},
        "The memory low point of GPU 0 (GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12) of rank 1 (target) of run r1 has "
        "been falling for 15 minutes at a rate that reaches zero within the hour.",
        [series("dflash_gpu_memory_headroom_min_bytes", {**RUN, **GPU}, "1000000000x60")]),   # low, but flat
    "DFlashMemoryHeadroomLow": (   # rank 0's forecast: 1.5x fits, then a forecast within 2% of the largest
        [series("dflash_memory_forecast_scale_ratio", {**DRAFTER, **FORECAST}, "1.5 1.5 1.02x10"),
         series("dflash_memory_forecast_scale_ratio", {**DRAFTER, "setting": "--num-anchors"}, "1024x12")], 7,
        {**DRAFTER, **FORECAST},
        "The memory forecast written by rank 0 (drafter) of run r1 puts the largest --tokens-per-batch that keeps 5% "
        "of every GPU free at 1.02 times the run's value, for 5 minutes: a step heavier than those it was fitted "
        "to, or an autotune, can raise an OOM.",
        [series("dflash_memory_forecast_scale_ratio", {**DRAFTER, **FORECAST}, "1.5 1.5 1.06x10"),   # 6% to spare
         series("dflash_memory_forecast_scale_ratio", {**DRAFTER, "setting": "--num-anchors"}, "1024x12")]),
    "DFlashDrafterStarved": (   # waits 0.5 s/s for 10 minutes, then 0.95: over 90% of the window from 19m
        wait(DRAFTER, "drafter.recv", "0+30x10 357+57x29"), 21, only(DRAFTER, ("job", "run", "rank", "role")),
        "Rank 0 (drafter) of run r1 waited on drafter.recv for 95% of the last 10 minutes: its targets (or the "
        "transfer) bound it.", wait(DRAFTER, "drafter.recv", "0+51x40")),
    "DFlashTargetBlocked": (
        wait(RUN, "transfer.wait_slot", "0+30x10 357+57x29"), 21, only(RUN, ("job", "run", "rank", "role")),
        "Rank 1 (target) of run r1 waited on transfer.wait_slot for 95% of the last 10 minutes: its drafter bounds "
        "it.", wait(RUN, "transfer.wait_slot", "0+51x40")),
    "DFlashThroughputDrop": (   # 1000 tokens/s for 70 minutes, then 300: under half the hour-earlier rate from 78m
        [series("dflash_tokens_total", RUN, "0+60000x70 4218000+18000x40")], 93,
        only(RUN, ("job", "run", "rank", "role")),
        "Rank 1 (target) of run r1 processes 300 tokens/s over the last 10 minutes, less than half of its rate an "
        "hour earlier.",
        [series("dflash_tokens_total", RUN, "0+60000x110"),
         series("dflash_tokens_total", {**RUN, "rank": "2"}, "0+60000x70 4200000x40")]),   # stopped: not a drop
    "DFlashExporterDroppingRecords": (
        [series("dflash_exporter_dropped_records_total", {**RUN, "exporter": "otel"}, "0 0 0 5x20")], 8,
        {**only(RUN), "exporter": "otel"},
        "The otel exporter of rank 1 (target) of run r1 dropped records in the last 10 minutes (its queue full or "
        "its exports failing).", [series("dflash_exporter_dropped_records_total", {**RUN, "exporter": "otel"}, "0x20")]),
    "DFlashProfilerOverhead": (   # 0.06 CPU s per wall s from the start: pending once 15 minutes are profiled
        [series("dflash_profiler_cpu_seconds_total", RUN, "0+3.6x40"),
         series("dflash_profiled_seconds_total", RUN, "0+60x40")], 30, only(RUN, ("job", "run", "rank", "role")),
        "The profiler's and exporters' threads of rank 1 (target) of run r1 used 6% of its wall time over the last "
        "15 minutes.",
        [series("dflash_profiler_cpu_seconds_total", RUN, "0+1.2x40"),
         series("dflash_profiled_seconds_total", RUN, "0+60x40")]),
}


def shipped_alerts() -> dict:
    (group,) = yaml.safe_load((GRAFANA / "dflash.rules.yml").read_text())["groups"]
    return {rule["alert"]: rule for rule in group["rules"] if "alert" in rule}


def spec() -> dict:
    """A promtool unit-test file covering every alert: fires, not before its `for:`, quiet on healthy series."""
    shipped, tests = shipped_alerts(), []
    for alert, (inputs, fire, labels, description, healthy) in CASES.items():
        rule = shipped[alert]
        expected = {"exp_labels": {**labels, "severity": rule["labels"]["severity"]},
                    "exp_annotations": {**rule["annotations"], "description": description}}
        tests.append({"interval": "1m", "input_series": inputs, "alert_rule_test": [
            {"eval_time": f"{fire - 1}m", "alertname": alert, "exp_alerts": []},
            {"eval_time": f"{fire}m", "alertname": alert, "exp_alerts": [expected]}]})
        tests.append({"interval": "1m", "input_series": healthy, "alert_rule_test": [
            {"eval_time": f"{m}m", "alertname": alert, "exp_alerts": []} for m in (fire - 1, fire, fire + 5)]})
    return {"rule_files": [str(GRAFANA / "dflash.rules.yml")],
            "evaluation_interval": "1m", "tests": tests}


def promtool_test(tmp_path: Path, content: dict) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    path = tmp_path / "dflash_test.yml"
    path.write_text(yaml.safe_dump(content, sort_keys=False))
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)


def test_every_alert_has_a_case():
    assert set(CASES) == set(shipped_alerts()) == {a.name for a in rules.alerts(rules.Scale(), wait_spans())}


def test_every_alert_fires_after_its_for_window_and_stays_quiet_on_a_healthy_run(tmp_path):
    done = promtool_test(tmp_path, spec())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_unit_tests_can_fail(tmp_path):
    """The same file with one expectation wrong (the hang alert's rank) fails: promtool checks what we say."""
    content = spec()
    hang = next(t for t in content["tests"] if t["alert_rule_test"][0]["alertname"] == "DFlashHang")
    hang["alert_rule_test"][1]["exp_alerts"][0]["exp_labels"]["rank"] = "7"
    done = promtool_test(tmp_path, content)
    assert done.returncode != 0 and "DFlashHang" in done.stdout + done.stderr


def test_a_rank_never_scraped_is_down_without_a_rank_label(tmp_path):
    endpoint = only(RUN, ("job", "run", "instance"))
    rule = shipped_alerts()["DFlashRankDown"]
    content = {"rule_files": [str(GRAFANA / "dflash.rules.yml")], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [series("up", endpoint, "0x5")], "alert_rule_test": [{
            "eval_time": "2m", "alertname": "DFlashRankDown", "exp_alerts": [{
                "exp_labels": {**endpoint, "severity": "critical"},
                "exp_annotations": {**rule["annotations"], "description": (
                    "Prometheus has not scraped a rank it never reached of run r1 at 127.0.0.1:9465 for 2 minutes "
                    "while the run's targets still list it: the rank's process is gone without having finished "
                    "its run.")}}]}]}]}
    done = promtool_test(tmp_path, content)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_roles_wait_share_sums_numerators_over_denominators(tmp_path):
    """Two drafters: rank 0 waits 0.75 s per second over 1.5 profiled seconds per second (two segments' intervals,
    say: a share of 0.5), rank 2 0.375 over 0.5 (0.75). The role's share is (0.75 + 0.375) / 2 = 0.5625, not the
    mean of the ratios (0.625)."""
    other = {**DRAFTER, "rank": "2", "instance": "127.0.0.1:9466"}
    inputs = [series("dflash_span_time_seconds_total", {**DRAFTER, "span": "drafter.recv", "clock": "cpu"}, "0+45x40"),
              series("dflash_profiled_seconds_total", DRAFTER, "0+90x40"),
              series("dflash_span_time_seconds_total", {**other, "span": "drafter.recv", "clock": "cpu"}, "0+22.5x40"),
              series("dflash_profiled_seconds_total", other, "0+30x40")]
    tests = [{"expr": rules.ROLE_WAIT_RATIO, "eval_time": "20m",
              "exp_samples": [{"labels": f'{rules.ROLE_WAIT_RATIO}{{job="dflash", role="drafter", run="r1"}}',
                               "value": 0.5625}]},
             {"expr": rules.RANK_WAIT_RATIO, "eval_time": "20m", "exp_samples": [
                 {"labels": f'{rules.RANK_WAIT_RATIO}{{job="dflash", rank="{r}", role="drafter", run="r1"}}',
                  "value": v} for r, v in (("0", 0.5), ("2", 0.75))]}]
    content = {"rule_files": [str(GRAFANA / "dflash.rules.yml")], "evaluation_interval": "1m",
               "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": tests}]}
    done = promtool_test(tmp_path, content)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_starting_rank_is_not_starved_before_its_window_is_full(tmp_path):
    """A drafter that waits for its first batches for 6 minutes (a target loading its model): with two samples in
    the window, rate() would make that the whole window's ratio; nothing fires before 10 minutes are profiled, and
    after them the window's share (0.6 at 10m, falling) is below the threshold."""
    inputs = wait(DRAFTER, "drafter.recv", "0+60x6 360+0x34")
    tests = [{"eval_time": f"{m}m", "alertname": "DFlashDrafterStarved", "exp_alerts": []} for m in (3, 5, 7, 9, 12)]
    content = {"rule_files": [str(GRAFANA / "dflash.rules.yml")], "evaluation_interval": "1m",
               "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": tests}]}
    done = promtool_test(tmp_path, content)
    assert done.returncode == 0, done.stdout + done.stderr
    unguarded = rules.RANK_WAIT_RATIO + '{role="drafter"} > ' + str(rules.STARVED_RATIO)
    content["tests"][0]["alert_rule_test"] = []
    content["tests"][0]["promql_expr_test"] = [{"expr": unguarded, "eval_time": "4m", "exp_samples": [
        {"labels": f'{rules.RANK_WAIT_RATIO}{{job="dflash", rank="0", role="drafter", run="r1"}}', "value": 1}]}]
    done = promtool_test(tmp_path, content)   # the ratio alone reads 1 there: the guard is what holds it
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_rank_sharing_its_gpu_with_the_other_side_is_never_blocked_or_starved(tmp_path):
    """A target waiting 95% of its time for its drafter: on a GPU of its own (another UUID than the drafter's) the
    GPU idles and DFlashTargetBlocked fires at 21m as in CASES; on the drafter's GPU (one GPU for both: the README's
    main job on CUDA) the GPU runs the drafter's step meanwhile, so neither wait alert fires. The same holds for
    a starved drafter on its target's GPU."""
    def gpu(labels: dict, uuid: str) -> dict:
        return series("dflash_gpu_memory_total_bytes", {**labels, "gpu": "0", "UUID": uuid}, "80000000000x40")

    shipped = shipped_alerts()
    inputs, fire, labels, description, _ = CASES["DFlashTargetBlocked"]
    blocked = {"exp_labels": {**labels, "severity": "warning"},
               "exp_annotations": {**shipped["DFlashTargetBlocked"]["annotations"], "description": description}}
    starving = wait(DRAFTER, "drafter.recv", "0+30x10 357+57x29")
    own = [*inputs, gpu(RUN, GPU["UUID"]), gpu(DRAFTER, "GPU-0d1e2f30-4152-6374-8596-a7b8c9d0e1f2")]
    shared = [*inputs, gpu(RUN, GPU["UUID"]), gpu(DRAFTER, GPU["UUID"])]
    shared_starved = [*starving, gpu(RUN, GPU["UUID"]), gpu(DRAFTER, GPU["UUID"])]
    quiet = [{"eval_time": f"{m}m", "alertname": a, "exp_alerts": []} for m in (fire, fire + 10)
             for a in ("DFlashTargetBlocked", "DFlashDrafterStarved")]
    content = {"rule_files": [str(GRAFANA / "dflash.rules.yml")], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": own, "alert_rule_test": [
            {"eval_time": f"{fire}m", "alertname": "DFlashTargetBlocked", "exp_alerts": [blocked]}]},
        {"interval": "1m", "input_series": shared, "alert_rule_test": quiet},
        {"interval": "1m", "input_series": shared_starved, "alert_rule_test": quiet}]}
    done = promtool_test(tmp_path, content)
    assert done.returncode == 0, done.stdout + done.stderr
    content["tests"] = content["tests"][:1]
    content["tests"][0]["input_series"] = starving + [gpu(DRAFTER, GPU["UUID"]), gpu(RUN, "GPU-0d1e2f30-4152")]
    content["tests"][0]["alert_rule_test"] = [{"eval_time": "21m", "alertname": "DFlashDrafterStarved", "exp_alerts": [
        {"exp_labels": {**only(DRAFTER, ("job", "run", "rank", "role")), "severity": "warning"},
         "exp_annotations": {**shipped["DFlashDrafterStarved"]["annotations"], "description": CASES[
             "DFlashDrafterStarved"][3]}}]}]
    done = promtool_test(tmp_path, content)   # a starved drafter on a GPU of its own still fires
    assert done.returncode == 0, done.stdout + done.stderr
