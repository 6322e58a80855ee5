"""The Grafana dashboard for DFlash training, generated from code and the pipeline's wait spans (given by the
caller: {span: role}): `python -m dflash.grafana dashboard` writes grafana/dflash.json (`--check`: exit 1 when the
committed file differs).

Panels are data (`Panel`, `Query`) in rows; `build_dashboard()` makes the JSON model with
grafana-foundation-sdk. Queries follow grafana/dashboard-linter's rules: the templated datasource, the
variable matchers in every selector, `$__rate_interval` in every rate/increase, a unit on every panel. A share
over several ranks is their summed numerators over their summed denominators, never an average of ratios.
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from exporters.generated import write_or_check
from exporters.catalog import COMMON_LABELS, FAMILIES, PROCESS_FAMILIES
from exporters.rules import ROLE_WAIT_RATIO

TITLE = "DFlash training"
DASHBOARD_UID = "dflash-training"
# The provisioned Prometheus data source (grafana/provisioning/datasources/prometheus.yml).
DATASOURCE_UID = "dflash-prometheus"
DATASOURCE_NAME = "Prometheus (dflash)"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "grafana" / "dflash.json"
# Label variables every selector filters on (dashboard-linter requires job and instance).
FILTER_VARIABLES = ("job", "run", "instance", "role", "rank")
ROLES = ("target", "drafter")
VARIABLE_LABELS = {label: "GPU" if label == "gpu" else label.capitalize() for label in FILTER_VARIABLES + ("gpu",)}
RATE = "$__rate_interval"
PANEL_HEIGHT = 8


@dataclass(frozen=True)
class Query:
    """One Prometheus target of a panel."""
    expr: str
    legend: str = ""
    instant: bool = False   # an instant query (a table's or bar gauge's), else a range query


@dataclass(frozen=True)
class Panel:
    """One panel: what it shows and how; `kind` is timeseries, stat, bargauge or table."""
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    width: int = 8
    kind: str = "timeseries"
    stack: bool = False
    bars: bool = False
    max: float | None = None
    # (value, color) steps above a base colour; a timeseries draws them as lines.
    thresholds: tuple[tuple[float, str], ...] = ()
    base_color: str = "green"
    height: int = PANEL_HEIGHT


def sel(key: str, suffix: str = "", **fixed: str) -> str:
    """`name{...}` for a catalog family (or a process one): the variable matchers (plus `$gpu`/`$clock` where the
    family has them) and fixed `label="value"` ones; a label the family lacks is a ValueError, so a typo fails."""
    family = FAMILIES.get(key) or PROCESS_FAMILIES[key]
    labels = COMMON_LABELS + family.labels
    matchers = [f'{var}=~"${var}"' for var in FILTER_VARIABLES]
    matchers += [f'{var}=~"${var}"' for var in ("gpu", "clock") if var in family.labels and var not in fixed]
    for label, value in fixed.items():
        if label not in labels:
            raise ValueError(f"{family.name} has no label {label!r} (labels: {', '.join(labels)})")
        matchers.append(f'{label}="{value}"')
    return f"{family.name}{suffix}{{{', '.join(matchers)}}}"


def recorded(rule: str, **fixed: str) -> str:
    """`rule{...}` for a recording rule: matchers for the variables among its level's labels (`job_run_role`:
    job, run, role) and fixed ones."""
    level = rule.split(":", 1)[0].split("_")
    matchers = [f'{var}=~"${var}"' for var in FILTER_VARIABLES if var in level]
    matchers += [f'{label}="{value}"' for label, value in fixed.items()]
    return f"{rule}{{{', '.join(matchers)}}}"


def _share(role: str) -> Panel:
    """A role's self-time share by span (its ranks' span self seconds over their profiled seconds, both moving
    with every tick); on the GPU clock scaled by spans over GPU-timed spans."""
    per_timed = (f"(rate({sel('span_count', role=role, clock='cpu')}[{RATE}]) / ignoring(clock) "
                 f"(rate({sel('span_count', role=role)}[{RATE}]) > 0))")
    spent = f"sum by (span) (rate({sel('span_self_time', role=role)}[{RATE}]) * ignoring(clock) {per_timed})"
    expr = f"{spent} / on () group_left sum(rate({sel('profiled_seconds', role=role)}[{RATE}]))"
    return Panel(f"{role.capitalize()} time share by span ($clock clock)",
                 f"Self seconds spent in each span per profiled second: the {role} ranks' span self time (a "
                 "child's time left out of its parent) over their profiled seconds (both summed over the ranks, "
                 "both updated every profile tick), stacked, so the stack stays within 100% per thread. On the "
                 "GPU clock, spans that carry no GPU time yet (or "
                 "sampled steps in an older run's log) are scaled in by spans over timed spans.",
                 "percentunit", (Query(expr, "{{span}}"),), stack=True)


def _token_weighted(key: str, by: str = "") -> str:
    """The drafters' interval means of a training metric weighted by the tokens each trained on in the interval
    (sum of value x tokens over the sum of tokens), not an average over ranks."""
    tokens = sel("tokens_rate", role="drafter")
    group = f" by ({by})" if by else ""
    return (f"sum{group} ({sel(key)} * on (job, run, instance, rank, role) group_left {tokens})"
            f" / on () group_left sum({tokens})")


# Firing DFlash alerts of the selected run; per-role alerts have no instance or rank, so those match empty too.
ALERTS = ('ALERTS{alertname=~"DFlash.+", alertstate="firing", job=~"$job", run=~"$run", instance=~"${instance}|", '
          'role=~"${role}|", rank=~"${rank}|"}')
_STEP_TIME = (f"(increase({sel('tokens', role='drafter')}[{RATE}])"
              f" / increase({sel('steps', role='drafter')}[{RATE}]))"
              f" / ({sel('tokens_rate', role='drafter')} > 0)")
_P95 = f"histogram_quantile(0.95, sum by (le, role, span) (rate({sel('span_seconds', '_bucket')}[{RATE}])))"
_MEAN = (f"sum by (role, span) (rate({sel('span_time')}[{RATE}]))"
         f" / sum by (role, span) (rate({sel('span_count')}[{RATE}]))")
GPU = "{{role}} {{rank}} gpu {{gpu}}"


def _bound(waits: dict) -> tuple:
    """A query per role that waits on the other side (`waits`: {span: role}): its ranks' wait share."""
    return tuple(Query(recorded(ROLE_WAIT_RATIO, role=role), f"{role}s wait: {ROLES[1 - ROLES.index(role)]}-bound")
                 for role in dict.fromkeys(waits.values()))


def _overview(waits: dict) -> tuple:
    """The first row: throughput, step time, which role bounds the run (from the roles' wait spans), the step."""
    return (
        Panel("Tokens per second by role",
              "Tokens per second over the last profile interval, summed over the role's ranks. Both roles "
              "handle the same tokens, so in a steady run the two lines meet; the lower one sets the pace.",
              "short", (Query(f"sum by (role) ({sel('tokens_rate')})", "{{role}}"),), width=8),
        Panel("Drafter step time",
              "Seconds per drafter optimiser step: tokens per step (tokens and steps counters over the rate "
              "window) divided by tokens per second. Gaps mean the window held no profile interval boundary.",
              "s", (Query(_STEP_TIME, "rank {{rank}}"),), width=6),
        Panel("Which role bounds the run (last 10 min)",
              "Share of the last 10 minutes each role spent waiting on the other side: its ranks' wait seconds "
              "over their profiled seconds (the recording rule " + ROLE_WAIT_RATIO + "). Targets waiting for a "
              "transfer slot means the drafters are the bottleneck; drafters waiting to receive means the targets "
              "are. Both high: the transfer itself bounds the run.",
              "percentunit", _bound(waits), width=6, kind="stat", max=1.0,
              thresholds=((0.1, "yellow"), (0.3, "red"))),
        Panel("Drafter step", "The drafters' current training step (highest over drafter ranks).",
              "none", (Query(f"max({sel('step', role='drafter')})", "step"),), width=4, kind="stat"),
    )


# The rows below the overview, top to bottom, each with its panels.
_BELOW_OVERVIEW = (("Step breakdown", (
        _share("target"),
        _share("drafter"),
        Panel("Span share of the last interval (busiest rank)",
              "Share of the last profile interval spent in each span on its busiest rank (GPU time when "
              "the span has it, else CPU): the hotspot table at a glance.", "percentunit",
              (Query(f"sort_desc(max by (role, span) ({sel('span_share')}))", "{{role}} {{span}}", instant=True),),
              kind="bargauge", max=1.0),
        Panel("p95 span time, last interval, exact ($clock clock)",
              "Exact 95th percentile of each span's whole durations in each rank's last profile interval: the "
              "run log's and dflash-report's figure for that window (one per rank: percentiles do not add).",
              "s", (Query(sel("span_p95"), "{{role}} {{rank}} {{span}}"),), width=8),
        Panel("p95 span time over the rate window, bucket estimate ($clock clock)",
              "An ESTIMATE: histogram_quantile over the span-time histogram's fixed buckets (0.0001 ... 0.5, 1, 2.5, "
              "5, 10, 30 ... 300 s), all selected ranks of a role together. It interpolates inside the bucket that "
              "holds the 95th percentile, so the true value can lie anywhere in that bucket: off by up to the "
              "bucket's upper bound over its lower one (2x to 3x; 2.5x between 1 and 2.5 s, where 2.212 s was read "
              "against an exact 1.512 s). The exact panel beside it gives the figure.", "s",
              (Query(_P95, "{{role}} {{span}}"),), width=8),
        Panel("Mean span time ($clock clock)",
              "Mean span duration per role: span seconds over spans completed, both updated every profile tick.",
              "s", (Query(_MEAN, "{{role}} {{span}}"),), width=8),
)), ("Pipeline flow", (
        Panel("Queue depth (drafters)",
              "Received batches waiting for each drafter: last, mean and max of the interval. Near zero "
              "means the drafter starves (target-bound); at its bound means the targets wait.",
              "short", (Query(sel("queue_depth", role="drafter"), "rank {{rank}} {{stat}}"),)),
        Panel("Wait shares",
              "Share of the interval each rank spent waiting on the other side: transfer.wait_slot on "
              "targets (waiting for the drafter), drafter.recv on drafters (waiting for data).",
              "percentunit", (Query(sel("wait_share"), "{{role}} {{rank}} {{span}}"),), max=1.0),
        Panel("Sequences and steps per second by role",
              "Sequences processed per second, summed over each role's ranks: over the rate window from the "
              "counter, and over each rank's last profile interval; and the drafters' optimiser steps per second "
              "over their last interval.",
              "short", (Query(f"sum by (role) (rate({sel('samples')}[{RATE}]))", "{{role}} sequences (rate window)"),
                        Query(f"sum by (role) ({sel('samples_rate')})", "{{role}} sequences (last interval)"),
                        Query(f"sum by (role) ({sel('steps_rate')})", "{{role}} steps (last interval)"))),
        Panel("Bytes moved per second by span", "Bytes moved by spans that declare bytes, per second.",
              "Bps", (Query(f"sum by (role, span) (rate({sel('span_bytes')}[{RATE}]))",
                            "{{role}} {{span}}"),)),
        Panel("Transfer bandwidth against its floor",
              "Achieved bandwidth of each byte-moving span in the last interval, and the floor measured at "
              "start for its kind of copy.", "Bps",
              (Query(sel("span_bandwidth"), "{{role}} {{rank}} {{span}}"),
               Query(f"max by (span, floor) ({sel('span_floor')})", "floor {{floor}} ({{span}})"))),
        Panel("Bandwidth as a share of its floor",
              "Achieved bandwidth over its floor: well below 100% means the copy is slower than this "
              "machine can do.", "percentunit",
              (Query(sel("span_floor_ratio"), "{{role}} {{rank}} {{span}}"),)),
)), ("Compute", (
        Panel("Model FLOP/s by role",
              "Model FLOPs per second (dflash/flops.py: matmuls at 2 a multiply-add, 3x forward for trained weights, "
              "masked-in attention pairs, padding not counted), summed over the role's ranks: over the rate window "
              "from the counter, and over each rank's last profile interval.", "flops",
              (Query(f"sum by (role) (rate({sel('model_flops')}[{RATE}]))", "{{role}} (rate window)"),
               Query(f"sum by (role) ({sel('model_flops_rate')})", "{{role}} (last interval)")), width=12),
        Panel("MFU by rank",
              "Model FLOPs utilisation of each rank: its model FLOP/s over the rate window divided by each of its "
              "device's peaks (dflash_peak_flops_per_second): the datasheet's dense bf16 peak (a GPU in its table) "
              "and the matmul rate measured at the rank's start (bf16 on a GPU, float32 on a CPU); beside it the "
              "last interval's own figure, dflash_mfu_ratio.",
              "percentunit",
              (Query(f"rate({sel('model_flops')}[{RATE}]) / ignoring(peak) group_right {sel('peak_flops')}",
                     "{{role}} {{rank}} of {{peak}} (rate window)"),
               Query(sel("mfu"), "{{role}} {{rank}} of {{peak}} (last interval)")), width=12),
)), ("Memory", (
        Panel("GPU memory headroom and its low point",
              "Free GPU memory now, and its lowest point in the interval (total minus the interval's peak "
              "used, which the 2 Hz sampler catches between intervals too).", "bytes",
              (Query(sel("gpu_headroom"), f"{GPU} now"), Query(sel("gpu_headroom_min"), f"{GPU} low point")),
              width=12),
        Panel("Lowest headroom share", "The lowest headroom of any selected GPU in its last interval, as "
              "a share of its memory. Red below 5%.", "percentunit",
              (Query(f"min({sel('gpu_headroom_ratio')})", "lowest"),), width=4, kind="stat", max=1.0,
              base_color="red", thresholds=((0.05, "yellow"), (0.1, "green"))),
        Panel("GPU memory used, peak and size", "NVML memory: used now, the interval's peak, and the total.",
              "bytes", (Query(sel("gpu_memory_used"), f"{GPU} used"),
                        Query(sel("gpu_memory_peak"), f"{GPU} peak"),
                        Query(sel("gpu_memory_total"), f"{GPU} total"))),
        Panel("Caching allocator", "PyTorch caching allocator: allocated and reserved now, and their peaks "
              "in the interval. Reserved far above allocated points at fragmentation.", "bytes",
              tuple(Query(sel(key), f"{GPU} {what}") for key, what in (
                  ("alloc_allocated", "allocated"), ("alloc_reserved", "reserved"),
                  ("alloc_peak_allocated", "peak allocated"), ("alloc_peak_reserved", "peak reserved"))),
              width=12),
        Panel("Allocator retries and OOMs", "cudaMalloc retries after freeing cached blocks (fragmentation) "
              "and out-of-memory errors, per rate window.", "short",
              (Query(f"increase({sel('alloc_retries')}[{RATE}])", f"{GPU} retries"),
               Query(f"increase({sel('alloc_ooms')}[{RATE}])", f"{GPU} OOMs")), width=12, bars=True),
)), ("Memory forecast", (
        Panel("Memory forecast: largest setting that fits",
              "Per setting (--tokens-per-batch, --max-length, --num-anchors), the largest value that keeps 5% of "
              "every GPU free, and the run's value, by the last memory_forecast event (rank 0 of a CUDA run, once every rank is "
              "past its warm-up; dflash-report hotspots gives the same forecast with its basis).", "short",
              (Query(sel("memory_forecast_largest"), "{{setting}} largest"),
               Query(f"{sel('memory_forecast_largest')} / ({sel('memory_forecast_scale')} > 0)",
                     "{{setting}} now")), width=10),
        Panel("Memory forecast: scale to the largest",
              "The largest value of each setting that fits over the run's value (1024: not limited by memory). "
              "Red below 1.05: the DFlashMemoryHeadroomLow alert (docs/RUNBOOK.md).", "none",
              (Query(f"min by (setting) ({sel('memory_forecast_scale')})", "{{setting}}"),), width=4,
              kind="stat", base_color="red", thresholds=((1.05, "yellow"), (1.25, "green"))),
        Panel("Memory forecast: need and limit on the limiting GPU",
              "What the ranks on the GPU that limits each setting need at the run's value (their fitted steps, a "
              "binding warm-up peak included), against what that GPU has for them (5% kept free, memory outside "
              "their allocators left out); gpu is host:index.", "bytes",
              (Query(sel("memory_forecast_need"), "{{setting}} need on {{limiting_gpu}}"),
               Query(sel("memory_forecast_limit"), "{{setting}} limit on {{limiting_gpu}}")), width=10),
)), ("GPU", (
        Panel("GPU utilisation", "Share of time the GPU was busy (NVML), interval mean.", "percentunit",
              (Query(sel("gpu_utilization"), GPU),), max=1.0),
        Panel("GPU power", "Power draw (NVML), interval mean.", "watt", (Query(sel("gpu_power"), GPU),)),
        Panel("GPU temperature", "Temperature (NVML), interval max.", "celsius",
              (Query(sel("gpu_temperature"), GPU),)),
        Panel("SM clock", "SM clock (NVML), last sample. A drop under load usually comes with a throttle "
              "reason.", "hertz", (Query(sel("gpu_sm_clock"), GPU),), width=12),
        Panel("Throttle reasons", "Number of selected GPUs with each NVML clock-event (throttle) reason "
              "active.", "short",
              (Query(f"sum by (reason) ({sel('gpu_throttle')})", "{{reason}}"),), width=12),
        Panel("SM, tensor and DRAM activity (GPM)",
              "NVML GPM (Hopper and later), interval means: SMs busy, warps resident over the maximum, any tensor "
              "pipe active, DRAM bandwidth over its peak. Utilisation near 100% with little tensor activity is a "
              "launch-bound GPU, not a compute-bound one. No data on GPUs without GPM.", "percentunit",
              tuple(Query(sel(key), f"{GPU} {what}") for key, what in (
                  ("gpu_sm_active", "SM active"), ("gpu_sm_occupancy", "SM occupancy"),
                  ("gpu_tensor_active", "tensor active"), ("gpu_dram_active", "DRAM bandwidth"))),
              width=24, max=1.0),
)), ("Host", (
        Panel("Process CPU", "CPU seconds per second (cores busy) of each rank's process over the rate window: "
              "training, its threads and native ones (process_cpu_seconds_total).", "short",
              (Query(f"rate({sel('process_cpu')}[{RATE}])", "{{role}} {{rank}}"),), width=6),
        Panel("Resident memory", "Resident memory of each rank's process at scrape time (host RAM; pinned "
              "buffers included).",
              "bytes", (Query(sel("process_resident_memory"), "{{role}} {{rank}}"),), width=6),
        Panel("Threads and open files", "OS threads (Python's and native ones) and open file descriptors of "
              "each rank's process, at scrape time.", "short",
              (Query(sel("process_threads"), "{{role}} {{rank}} threads"),
               Query(sel("process_open_fds"), "{{role}} {{rank}} open fds")), width=6),
        Panel("CPU by thread", "CPU seconds per second of the busiest Python threads of each rank (by thread "
              "name) over the rate window: which thread is hot.", "short",
              (Query(f"topk(8, sum by (role, rank, thread) (rate({sel('thread_cpu')}[{RATE}])))",
                     "{{role}} {{rank}} {{thread}}"),), width=6),
)), ("Training", (
        Panel("Loss", "Drafter loss per drafter rank, interval mean.", "none",
              (Query(sel("train_loss"), "rank {{rank}}"),)),
        Panel("Accuracy by block position (acc_k)", "Drafter top-1 accuracy at block position k, interval "
              "mean, over the drafter ranks weighted by the tokens each trained on in the interval.", "percentunit",
              (Query(_token_weighted("train_accuracy", "position"), "acc_{{position}}"),), max=1.0),
        Panel("Acceptance length (tau)", "Tokens produced per verify step: tau simulated from acc_k, and "
              "tau_prefix from teacher-forced accepted prefixes; interval means over the drafter ranks weighted "
              "by their tokens.", "none",
              (Query(_token_weighted("train_tau"), "tau (simulated acceptance)"),
               Query(_token_weighted("train_tau_prefix"), "tau_prefix (teacher-forced prefix)"))),
        Panel("Learning rate", "Learning rate, last of the interval (highest over drafter ranks).", "sci",
              (Query(f"max({sel('train_learning_rate')})", "lr"),), width=12),
        Panel("Gradient norm", "Gradient norm before clipping per drafter rank, interval mean.", "none",
              (Query(sel("train_grad_norm"), "rank {{rank}}"),), width=12),
)), ("Numerics", (
        Panel("Largest |x| by stage", "Largest finite value of each stage's tensor over the interval's sampled "
              "steps (packed hidden per target layer, the drafter's input, each drafter layer's output, loss, "
              "gradient norm, update ratio): a line climbing steadily on a log scale is a drift toward overflow.",
              "sci", (Query(sel("numerics_absmax"), "{{role}} {{rank}} {{span}} {{tensor}}"),), width=6),
        Panel("RMS by stage", "Root mean square of each stage's tensor at the interval's last sampled step.", "sci",
              (Query(sel("numerics_rms"), "{{role}} {{rank}} {{span}} {{tensor}}"),), width=6),
        Panel("Growth per step", "Growth factor per step of each stage's largest |x| over the interval (1: flat). "
              "Sustained above 1.19 (a quarter binade a step) with the value out of its baseline band, the "
              "DFlashNumericsDrift alert fires (docs/RUNBOOK.md).", "none",
              (Query(sel("numerics_growth"), "{{role}} {{rank}} {{span}} {{tensor}}"),), width=6,
              thresholds=((1.19, "orange"),)),
        Panel("Headroom to overflow", "Doublings left between each stage's largest |x| and its dtype's largest "
              "value, and the share of values near overflow or below the smallest normal value.", "none",
              (Query(sel("numerics_headroom"), "{{role}} {{rank}} {{span}} {{tensor}} binades"),
               Query(sel("numerics_out_of_range"), "{{role}} {{rank}} {{span}} {{tensor}} {{bound}} share")),
              width=6, thresholds=((8.0, "red"),)),
)), ("Health", (
        Panel("Heartbeat age", "Seconds since each rank's last run-log record. Rising means the rank has "
              "stopped writing (hung); a line that ends means its endpoint is gone.", "s",
              (Query(f"time() - {sel('heartbeat')}", "{{role}} {{rank}}"),), width=6,
              thresholds=((180.0, "red"),)),
        Panel("Profile intervals closed", "Intervals each rank closed per rate window: a rank at 0 has "
              "stopped closing intervals.", "short",
              (Query(f"increase({sel('intervals')}[{RATE}])", "{{role}} {{rank}}"),), width=6, bars=True),
        Panel("Events by kind", "Run-log events per rate window by kind (nonfinite, oom, thread_crash, "
              "signal, bad_records, hang, ...).", "short",
              (Query(f"sum by (kind) (increase({sel('events')}[{RATE}]))", "{{kind}}"),), width=6, bars=True),
        Panel("Exporter dropped records", "Records an exporter dropped (queue full or export failed), per "
              "rate window.", "short",
              (Query(f"sum by (role, rank, exporter) (increase({sel('exporter_dropped')}[{RATE}]))",
                     "{{role}} {{rank}} {{exporter}}"),), width=6, bars=True),
        Panel("Profiler CPU", "CPU time of the profiler's and its exporters' threads (collector, exporter, "
              "NVML, stacks, control; the metrics endpoint, OpenTelemetry) over each interval's wall time: the "
              "background cost of profiling, which under the GIL the training thread partly waits for. "
              "dflash-report flags a rank above 2%; a longer --profile-interval lowers it. Per interval, and "
              "over the rate window (CPU seconds over profiled seconds).", "percentunit",
              (Query(sel("profiler_cpu"), "{{role}} {{rank}} interval"),
               Query(f"rate({sel('profiler_cpu_seconds')}[{RATE}]) / rate({sel('profiled_seconds')}[{RATE}])",
                     "{{role}} {{rank}} rate window")), width=24, thresholds=((0.02, "orange"),)),
        Panel("Firing alerts", "DFlash alerts firing (grafana/dflash.rules.yml; docs/RUNBOOK.md says what each "
              "means), by alert, severity and rank. Empty while all is well.", "short",
              (Query(f"count by (alertname, severity, rank) ({ALERTS})", "{{alertname}} ({{severity}}) rank {{rank}}"),),
              width=12, bars=True),
        Panel("Run end", "Unix time each rank wrote its run_end, by status (ok, hang, oom: ..., killed: ...).",
              "dateTimeAsIso", (Query(sel("run_end"), "{{role}} {{rank}} {{status}}", instant=True),), width=12,
              kind="table"),
        Panel("Build info", "Versions and device of each rank.", "none",
              (Query(sel("build_info"), instant=True),), width=24, kind="table", height=6),
)))


def rows(waits: dict) -> tuple:
    """The dashboard's rows, top to bottom, each with its panels; `waits`: the pipeline's wait spans ({span: role})."""
    return (("Overview", _overview(waits)), *_BELOW_OVERVIEW)


def _datasource_ref():
    """The templated data source every panel, target and variable uses (dashboard-linter's rule)."""
    from grafana_foundation_sdk.models.dashboard import DataSourceRef
    return DataSourceRef(type_val="prometheus", uid="${datasource}")


def _variables() -> list:
    """Template variables: the data source, label filters chained left to right, and the span clock."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.models import dashboard as dm

    out = [db.DatasourceVariable("datasource").label("Data source").type("prometheus")
           .current(dm.VariableOption(text=DATASOURCE_NAME, value=DATASOURCE_UID))]
    info = FAMILIES["build_info"].name
    labels = FILTER_VARIABLES + ("gpu",)
    for i, label in enumerate(labels):
        metric = FAMILIES["gpu_memory_total"].name if label == "gpu" else info
        upstream = ", ".join(f'{v}=~"${v}"' for v in labels[:i])
        selector = f"{metric}{{{upstream}}}" if upstream else metric
        out.append(db.QueryVariable(label).label(VARIABLE_LABELS[label]).datasource(_datasource_ref())
                   .query(f"label_values({selector}, {label})")
                   .multi(True).include_all(True).all_value(".+")
                   .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC))
    spans = FAMILIES["span_seconds"].name + "_count{" + ", ".join(f'{v}=~"${v}"' for v in FILTER_VARIABLES) + "}"
    out.append(db.QueryVariable("clock").label("Span clock").datasource(_datasource_ref())
               .query(f"label_values({spans}, clock)")
               .description("Span times on GPU events or CPU wall clock, as the selected ranks report them: gpu "
                            "first where there is GPU time, cpu on a CPU-only run.")
               .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_DESC))
    return out


def _target(query: Query, ref_id: str, table: bool):
    """The SDK builder for one Prometheus target."""
    from grafana_foundation_sdk.builders import prometheus
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    target = prometheus.Dataquery().expr(query.expr).ref_id(ref_id).datasource(_datasource_ref())
    if query.legend:
        target = target.legend_format(query.legend)
    if query.instant:
        target = target.instant()
    if table:
        target = target.format(PromQueryFormat.TABLE)
    return target


def _panel(panel: Panel, panel_id: int):
    """The SDK builder for one panel."""
    from grafana_foundation_sdk.builders import bargauge, common as cb, dashboard as db, stat, table, timeseries
    from grafana_foundation_sdk.models import common as cm, dashboard as dm

    kinds = {"timeseries": timeseries.Panel, "stat": stat.Panel, "bargauge": bargauge.Panel, "table": table.Panel}
    builder = (kinds[panel.kind]().id(panel_id).title(panel.title).description(panel.description).unit(panel.unit)
               .datasource(_datasource_ref()).height(panel.height).span(panel.width)
               .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
                   [dm.Threshold(value=None, color=panel.base_color)]
                   + [dm.Threshold(value=value, color=color) for value, color in panel.thresholds])))
    for i, query in enumerate(panel.queries):
        builder = builder.with_target(_target(query, chr(ord("A") + i), panel.kind == "table"))
    if panel.max is not None:
        builder = builder.min(0).max(panel.max)
    if panel.kind == "timeseries":
        builder = builder.legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
                                 .placement(cm.LegendPlacement.BOTTOM).show_legend(True))
        if panel.stack:
            builder = builder.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(40)
        if panel.bars:
            builder = builder.draw_style(cm.GraphDrawStyle.BARS).fill_opacity(60)
        if panel.thresholds:   # drawn as dashed lines
            builder = builder.thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphTresholdsStyleMode.DASHED))
    elif panel.kind == "stat":
        builder = builder.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
    elif panel.kind == "bargauge":
        builder = (builder.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
                   .orientation(cm.VizOrientation.HORIZONTAL).display_mode(cm.BarGaugeDisplayMode.GRADIENT))
    else:
        hidden = {"Time": True, "Value": True, "__name__": True}
        builder = builder.show_header(True).with_transformation(dm.DataTransformerConfig(
            id_val="organize", options={"excludeByName": hidden}))
    return builder


def build_dashboard(waits: dict) -> dict:
    """The dashboard's JSON model (what `grafana/dflash.json` holds); `waits`: the pipeline's wait spans."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dm

    builder = (db.Dashboard(TITLE).uid(DASHBOARD_UID).tags(["dflash", "training"]).readonly()
               .description("DFlash drafter training: throughput, step breakdown, pipeline flow, memory, "
                            "GPUs, training metrics and health, from the dflash_* Prometheus metrics.")
               .tooltip(dm.DashboardCursorSync.CROSSHAIR).refresh("1m").time("now-1h", "now")
               .timezone("browser"))
    for variable in _variables():
        builder = builder.with_variable(variable)
    # run-log events and firing alerts as marks on every time series
    builder = builder.annotation(db.AnnotationQuery().name("Run events").datasource(_datasource_ref()).enable(True)
                                 .icon_color("red").expr(f"sum by (kind) (increase({sel('events')}[{RATE}])) > 0"))
    builder = builder.annotation(db.AnnotationQuery().name("Alerts").datasource(_datasource_ref()).enable(True)
                                 .icon_color("orange").expr(f"count by (alertname, rank) ({ALERTS})"))
    ids = itertools.count(1)
    for title, panels in rows(waits):
        builder = builder.with_row(db.Row(title).id(next(ids)))
        for panel in panels:
            builder = builder.with_panel(_panel(panel, next(ids)))
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def render(dashboard: dict) -> str:
    """The committed file's text: two-space indented JSON and a final newline."""
    return json.dumps(dashboard, indent=2) + "\n"


def main(argv: list[str] | None, waits: dict, module: str) -> int:
    """Write the dashboard JSON, or with --check say whether the file on disk is current (exit 1 if not): the
    command line of `python -m MODULE` (dflash/grafana.py), which gives the pipeline's wait spans ({span: role})."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="dashboard JSON path (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when --out differs from the generated dashboard")
    args = parser.parse_args(argv)
    text = render(build_dashboard(waits))
    return write_or_check(args.out, text, module, args.check)
