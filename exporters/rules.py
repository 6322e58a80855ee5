"""Prometheus recording rules and alerts for DFlash training, generated from the catalog and the pipeline's wait
spans (given by the caller: {span: role}) as the dashboard is: `python -m dflash.grafana rules` writes
grafana/dflash.rules.yml; `--check` exits 1 when the committed file differs.
The recording rules and the alerts are one group, records first: Prometheus evaluates a group's rules in order,
so each alert reads the recordings of the same evaluation (separate groups would lag by up to one interval).

The monitoring-mixins conventions: recording rules named `level:metric:operations`; alerts named `DFlash...` in
CamelCase, each with `for:`, a `severity` of critical, warning or info, a static `summary`, a templated
`description` naming the run and the rank, and a `runbook_url` to its section of docs/RUNBOOK.md.

`--time-scale F` multiplies every duration (range windows, offsets, `for:`, prediction horizons and the time
thresholds) by F, expressions otherwise the same: the end-to-end test loads such a copy so that alerts meant
for minutes fire within seconds. The shipped files are F = 1; `promtool test rules` proves their real windows.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from exporters.generated import write_or_check
from exporters.catalog import FAMILIES

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "grafana" / "dflash.rules.yml"
RUNBOOK = "docs/RUNBOOK.md"
JOB = 'job="dflash"'           # the scrape job of grafana/prometheus.yml
RUN_LABELS = "job, run, instance, rank, role"   # what identifies a rank's series (instance: its endpoint)
SEVERITIES = ("critical", "warning", "info")
# Thresholds (dimensionless; the time ones live in the rules below, in seconds, so they scale).
HEADROOM_LOW_RATIO = 0.05
FORECAST_SCALE_LOW_RATIO = 1.05
STARVED_RATIO = 0.9
THROUGHPUT_DROP_RATIO = 0.5
PROFILER_CPU_RATIO = 0.05


@dataclass(frozen=True)
class Scale:
    """Durations in rules, multiplied by `factor` (1: the shipped rules)."""
    factor: float = 1.0

    def seconds(self, seconds: float) -> float:
        return seconds * self.factor

    def __call__(self, seconds: float) -> str:
        """A Prometheus duration (`10m`, `1h`, `1500ms`) of `seconds` times the factor."""
        ms = round(seconds * self.factor * 1000)
        if ms <= 0:
            raise ValueError(f"duration {seconds} s x {self.factor} rounds to nothing")
        for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
            if ms % size == 0:
                return f"{ms // size}{unit}"
        return f"{ms}ms"

    def at_least(self, seconds: float, floor_s: float) -> str:
        """`seconds` times the factor as a duration, but never under `floor_s` (a lag outside the rules that no
        time scale shortens)."""
        return self(max(seconds, floor_s / self.factor))

    def number(self, seconds: float) -> str:
        """A number of seconds (a threshold, a horizon) times the factor, as PromQL writes it."""
        return f"{self.seconds(seconds):g}"


@dataclass(frozen=True)
class Record:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_s: float
    severity: str
    summary: str
    description: str
    min_for_s: float = 0.0
    """The shortest `for:` at any time scale (`Scale.at_least`)."""


def name(key: str) -> str:
    """A catalog family's Prometheus name (a KeyError for a family that does not exist)."""
    return FAMILIES[key].name


def wait_seconds_rate(window: str, waits: dict) -> str:
    """Seconds per second each rank spent in its role's wait spans (`waits`: {span: role}), from the tick-fed span
    time."""
    return " or ".join(
        f'sum by (job, run, rank, role) (rate({name("span_time")}{{{JOB}, clock="cpu", role="{role}", '
        f'span="{span}"}}[{window}]))' for span, role in waits.items())


# Recording rule names, used by the alerts and the dashboard.
RANK_WAIT = "job_run_rank_role:dflash_wait_seconds:rate10m"
RANK_PROFILED = "job_run_rank_role:dflash_profiled_seconds:rate10m"
RANK_WAIT_RATIO = "job_run_rank_role:dflash_wait_seconds_per_profiled_seconds:ratio_rate10m"
ROLE_WAIT_RATIO = "job_run_role:dflash_wait_seconds_per_profiled_seconds:ratio_rate10m"
TOKENS_RATE = "job_run_rank_role:dflash_tokens:rate10m"
PROFILER_RATIO = "job_run_rank_role:dflash_profiler_cpu_seconds_per_profiled_seconds:ratio_rate15m"
RANK_BY = "job, run, rank, role"


def records(d: Scale, waits: dict) -> list[Record]:
    """The recording rules: what the alerts and the dashboard aggregate; a role's share is the sum of its ranks'
    numerators over the sum of their denominators, never an average of ratios. `waits`: {span: role}."""
    profiled = f'{name("profiled_seconds")}{{{JOB}}}'
    return [
        Record(RANK_WAIT, wait_seconds_rate(d(600), waits)),
        Record(RANK_PROFILED, f"sum by ({RANK_BY}) (rate({profiled}[{d(600)}]))"),
        Record(RANK_WAIT_RATIO, f"{RANK_WAIT} / {RANK_PROFILED}"),
        Record(ROLE_WAIT_RATIO, f"sum by (job, run, role) ({RANK_WAIT}) / sum by (job, run, role) ({RANK_PROFILED})"),
        Record(TOKENS_RATE, f'sum by ({RANK_BY}) (rate({name("tokens")}{{{JOB}}}[{d(600)}]))'),
        Record(PROFILER_RATIO,
               f'sum by ({RANK_BY}) (rate({name("profiler_cpu_seconds")}{{{JOB}}}[{d(900)}])) / '
               f"sum by ({RANK_BY}) (rate({profiled}[{d(900)}]))"),
    ]


def _event(kind: str, d: Scale) -> str:
    """New run-log events of `kind` in the last 10 minutes, per rank."""
    return (f'sum by ({RUN_LABELS}) (increase({name("events")}{{{JOB}, kind="{kind}"}}[{d(600)}])) > 0')


DISCOVERY_LAG_S = 10.0
"""Prometheus's discovery manager passes file_sd changes to the scrapers every 5 s: a run that withdraws its
targets at its clean end is still scraped, `up == 0`, for up to that long after its processes exit. DFlashRankDown
waits longer than that at any time scale (the shipped 2 minutes are far above it)."""


def _rank_down(d: Scale) -> str:
    """Targets Prometheus cannot scrape, with the rank and role they last reported (from the build info of the last
    hour) where they ever did, else without them."""
    down = f"up{{{JOB}}} == 0"
    known = (f"({down}) * on (job, run, instance) group_left (rank, role) "
             f'max by (job, run, instance, rank, role) (last_over_time({name("build_info")}{{{JOB}}}[{d(3600)}]))')
    return f"{known} or ({down} unless on (job, run, instance) ({known}))"


def _heartbeat(d: Scale) -> str:
    """A rank still scraped whose last record is older than three of its intervals (their mean length over the
    last hour) and than 5 minutes; a rank whose run has ended is left out."""
    age = f'(time() - {name("heartbeat")}{{{JOB}}})'
    interval = (f'rate({name("profiled_seconds")}{{{JOB}}}[{d(3600)}]) / '
                f'rate({name("intervals")}{{{JOB}}}[{d(3600)}])')
    return (f"{age} > on ({RUN_LABELS}) clamp_min(3 * {interval}, {d.number(300)}) "
            f'unless on ({RUN_LABELS}) {name("run_end")}{{{JOB}}}')


def _full_window(seconds: float, d: Scale) -> str:
    """`and` the rank has profiled at least `seconds` since it started: a ratio over a window is only read once
    the window is full (with two samples of a starting rank, rate() makes one interval's ratio the window's)."""
    return (f'and on ({RANK_BY}) sum by ({RANK_BY}) ({name("profiled_seconds")}{{{JOB}}}) '
            f">= {d.number(seconds)}")


def _own_gpu(role: str, other: str) -> str:
    """`unless` the rank shares its GPU (by UUID, in its run) with a rank of role `other`: one GPU running both
    sides is never idle while one of them waits, so the wait alerts' remedy (rebalance the GPUs) does not apply."""
    def gpus(r: str) -> str:
        return f'{name("gpu_memory_total")}{{{JOB}, UUID!="", role="{r}"}}'
    return (f"unless on ({RANK_BY}) (group by ({RANK_BY}, UUID) ({gpus(role)}) "
            f"and on (job, run, UUID) group by (job, run, UUID) ({gpus(other)}))")


def _waits(role: str, other: str, d: Scale) -> str:
    """A `role` rank's wait share over its full 10-minute window above STARVED_RATIO, on a GPU of its own."""
    return f'{RANK_WAIT_RATIO}{{role="{role}"}} > {STARVED_RATIO} {_full_window(600, d)} {_own_gpu(role, other)}'


def _headroom_predicted(d: Scale) -> str:
    low = f'{name("gpu_headroom_min")}{{{JOB}}}'
    return f"predict_linear({low}[{d(3600)}], {d.number(3600)}) < 0 and {low} > 0"


RANK = "rank {{ $labels.rank }} ({{ $labels.role }}) of run {{ $labels.run }}"
RANK_FIRST = RANK[0].upper() + RANK[1:]


def alerts(d: Scale, waits: dict) -> list[Alert]:
    """Every alert, in the order of docs/RUNBOOK.md; `waits`: {span: role}, the spans the wait alerts name."""
    return _failure_alerts(d) + _health_alerts(d, waits)


def _failure_alerts(d: Scale) -> list[Alert]:
    """A rank gone, silent or failed, and the failures its forensics record."""
    return [
        Alert("DFlashRankDown", _rank_down(d), 120, "critical", "A training rank's metrics endpoint is gone.",
              "Prometheus has not scraped {{ if $labels.rank }}rank {{ $labels.rank }} ({{ $labels.role }})"
              "{{ else }}a rank it never reached{{ end }} of run {{ $labels.run }} at {{ $labels.instance }} for 2 "
              "minutes while the run's targets still list it: the rank's process is gone without having finished "
              "its run.", min_for_s=DISCOVERY_LAG_S),
        Alert("DFlashRankSilent", _heartbeat(d), 120, "warning", "A training rank stopped writing records.",
              "The last record of " + RANK + " is {{ $value | humanizeDuration }} old, more than three of its "
              "profile intervals: its collector or exporter thread is stuck."),
        Alert("DFlashRankFailed",
              f'last_over_time({name("run_end")}{{{JOB}, status!="ok"}}[{d(600)}])', 60, "critical",
              "A training rank ended its run with a failure.",
              RANK_FIRST + ' ended with status "{{ $labels.status }}".'),
        Alert("DFlashNonFiniteValue", _event("nonfinite", d), 60, "critical",
              "A training rank found a NaN or Inf.",
              RANK_FIRST + " found a NaN or Inf in the last 10 minutes; the run log's first nonfinite event "
              "names the span, step and tensor."),
        Alert("DFlashOutOfMemory",
              _event("oom", d) + f' or sum by ({RUN_LABELS}) (increase({name("alloc_ooms")}{{{JOB}}}[{d(600)}])) > 0',
              60, "critical", "A training rank ran out of GPU memory.",
              RANK_FIRST + " raised an out-of-memory error in the last 10 minutes."),
        Alert("DFlashThreadCrashed", _event("thread_crash", d), 60, "critical", "A training rank's thread crashed.",
              "A thread of " + RANK + " ended with an exception in the last 10 minutes; the rank stops."),
        Alert("DFlashHang", _event("hang", d), 60, "critical", "A training rank hung and was stopped.",
              "The hang watchdog of " + RANK + " saw no progress for its timeout, dumped every thread and "
              "stopped the rank."),
        Alert("DFlashNumericsDrift", _event("numerics_drift", d), 60, "warning",
              "A training rank's numbers are drifting toward overflow.",
              RANK_FIRST + " warned of a numerics drift in the last 10 minutes: a stage's statistic grows "
              "geometrically, nears its dtype's range or its update ratio jumped, before any NaN or Inf; the run "
              "log's numerics_drift event names the span, tensor, trend and steps left to overflow."),
    ]


def _waited_on(role: str, waits: dict) -> str:
    """The wait spans of `role` as an alert's description names them."""
    return " or ".join(sorted(span for span, r in waits.items() if r == role))


def _health_alerts(d: Scale, waits: dict) -> list[Alert]:
    """GPU memory, the pipeline's balance, throughput and the telemetry's own health."""
    return [
        Alert("DFlashGpuMemoryHeadroomLow", f'{name("gpu_headroom_ratio")}{{{JOB}}} < {HEADROOM_LOW_RATIO}', 300,
              "warning", "A GPU is within 5% of running out of memory.",
              "GPU {{ $labels.gpu }} ({{ $labels.UUID }}) of " + RANK + " had its memory low point at "
              "{{ $value | humanizePercentage }} of its size in each interval for 5 minutes."),
        Alert("DFlashGpuMemoryHeadroomExhausting", _headroom_predicted(d), 900, "warning",
              "A GPU's memory headroom is predicted to run out within the hour.",
              "The memory low point of GPU {{ $labels.gpu }} ({{ $labels.UUID }}) of " + RANK + " has been "
              "falling for 15 minutes at a rate that reaches zero within the hour."),
        Alert("DFlashMemoryHeadroomLow",
              f'{name("memory_forecast_scale")}{{{JOB}}} < {FORECAST_SCALE_LOW_RATIO}', 300, "warning",
              "The memory forecast puts a training setting within 5% of the largest that fits.",
              "The memory forecast written by " + RANK + " puts the largest {{ $labels.setting }} that keeps 5% "
              "of every GPU free at {{ $value | humanize }} times the run's value, for 5 minutes: a step heavier "
              "than those it was fitted to, or an autotune, can raise an OOM."),
        Alert("DFlashDrafterStarved", _waits("drafter", "target", d), 120, "warning",
              "A drafter waits for its targets nearly all the time.",
              RANK_FIRST + f" waited on {_waited_on('drafter', waits)} for {{{{ $value | humanizePercentage }}}} "
              "of the last 10 minutes: "
              "its targets (or the transfer) bound it."),
        Alert("DFlashTargetBlocked", _waits("target", "drafter", d), 120, "warning",
              "A target waits for its drafter nearly all the time.",
              RANK_FIRST + f" waited on {_waited_on('target', waits)} for {{{{ $value | humanizePercentage }}}} "
              "of the last 10 minutes: its drafter bounds it."),
        Alert("DFlashThroughputDrop",
              f"{TOKENS_RATE} < {THROUGHPUT_DROP_RATIO} * ({TOKENS_RATE} offset {d(3600)}) and {TOKENS_RATE} > 0",
              900, "warning", "Training throughput fell by more than half against an hour earlier.",
              RANK_FIRST + " processes {{ $value | humanize }} tokens/s over the last 10 minutes, less than half "
              "of its rate an hour earlier."),
        Alert("DFlashExporterDroppingRecords",
              f'sum by ({RUN_LABELS}, exporter) (increase({name("exporter_dropped")}{{{JOB}}}[{d(600)}])) > 0',
              300, "warning", "A telemetry exporter is dropping records.",
              "The {{ $labels.exporter }} exporter of " + RANK + " dropped records in the last 10 minutes (its "
              "queue full or its exports failing)."),
        Alert("DFlashProfilerOverhead", f"{PROFILER_RATIO} > {PROFILER_CPU_RATIO} {_full_window(900, d)}", 900, "info",
              "Profiling takes more than 5% of a rank's time.",
              "The profiler's and exporters' threads of " + RANK + " used {{ $value | humanizePercentage }} of its "
              "wall time over the last 15 minutes."),
    ]


def anchor(alert_name: str) -> str:
    """The docs/RUNBOOK.md anchor of an alert's section (GitHub's slug of a `## Name` heading)."""
    return alert_name.lower()


def rule_groups(d: Scale, waits: dict, runbook_base: str = RUNBOOK) -> dict:
    """The rule file's content: one group, the recording rules then the alerts; `waits`: {span: role}."""
    recording = [{"record": r.record, "expr": r.expr} for r in records(d, waits)]
    alerting = [{"alert": a.name, "expr": a.expr, "for": d.at_least(a.for_s, a.min_for_s), "labels": {"severity": a.severity},
                 "annotations": {"summary": a.summary, "description": a.description,
                                 "runbook_url": f"{runbook_base}#{anchor(a.name)}"}} for a in alerts(d, waits)]
    return {"groups": [{"name": "dflash", "rules": recording + alerting}]}


def render(groups: dict, scale: Scale, module: str) -> str:
    """The rule file's text: a header saying how it was made (`python -m MODULE`), then YAML."""
    import yaml

    how = f"python -m {module}" + (f" --time-scale {scale.factor:g}" if scale.factor != 1 else "")
    return (f"# Generated by `{how}` from exporters/rules.py; do not edit by hand.\n"
            + yaml.safe_dump(groups, sort_keys=False, width=120, allow_unicode=True))


def main(argv: list[str] | None, waits: dict, module: str) -> int:
    """Write the rule file, or with --check say whether the file on disk is current (exit 1 if not): the command
    line of `python -m MODULE` (dflash/grafana.py), which gives the pipeline's wait spans (`waits`: {span: role})."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="rule file (default: %(default)s)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every duration by this (tests: short windows; default: %(default)s)")
    parser.add_argument("--runbook-base", default=RUNBOOK,
                        help="where docs/RUNBOOK.md is browsable, for the alerts' runbook_url (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file differs")
    args = parser.parse_args(argv)
    if not args.time_scale > 0:
        parser.error(f"--time-scale must be > 0, got {args.time_scale}")
    scale = Scale(args.time_scale)
    text = render(rule_groups(scale, waits, args.runbook_base), scale, module)
    return write_or_check(args.out, text, module, args.check)
