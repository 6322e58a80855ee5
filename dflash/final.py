"""What rank 0 prints when the run ends, once every rank has written its run_end: the whole-run hotspot table,
the wall time from launch to the end, the verdict and the top findings (report's facade on the run directory:
the analysis `dflash-report hotspots` prints in full), and that command. A run stopped by a signal prints its
stop line instead of the verdict and findings: it is exiting inside a scheduler's grace period."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import profiler
from dflash.cli_output import command_for
from profiler.schema.records import printable, rank_logs

TOP_FINDINGS = 3
"""Findings shown at the end of a run; `dflash-report hotspots` shows them all."""


def print_final(run_dir: Path, origin: str, origin_unix_ns: int, stop_line: str | None = None,
                out=None, err=None, on_report=None) -> None:
    """The end of the run on `out` (stdout), the stop line on `err` (stderr). `origin`: what `origin_unix_ns`
    is (`launch`: dflash-train's start; `process`: this rank's, under torchrun). on_report: given the run's
    report (report.hotspots) where one was made (not after a stop: the run is exiting) and the last step the
    run_ends say, e.g. the run's view for the per-rank sinks (exporters/run_view.py)."""
    from exporters.console import format_hotspots

    out, err = out or sys.stdout, err or sys.stderr
    ends, steady, starts = [], [], []
    for path in rank_logs(run_dir).values():
        records, _ = profiler.read_records(path)
        ends += [r for r in records if r.get("type") == "run_end"]
        steady += [r for r in records if r.get("type") == "event" and r.get("kind") == "throughput"][-1:]
        starts += [r for r in records if r.get("type") == "run_start"][-1:]
    lines = [format_hotspots(ends, steady, starts)] if ends else []
    lines.append(f"wall time: {format_duration((time.time_ns() - origin_unix_ns) / 1e9)} from {origin} to the end")
    if stop_line is None:
        rep = _report(run_dir)
        lines += verdict_and_findings(rep) if isinstance(rep, dict) else [rep]
        if on_report is not None and isinstance(rep, dict):
            last_step = max((e["step"] for e in ends if isinstance(e.get("step"), int)), default=0)
            lines += _handed(on_report, rep, last_step)
    lines += [f"full report: {command_for('dflash-report')} hotspots {shlex.quote(str(run_dir))}",
              f"run directory: {run_dir}"]
    print(printable("\n".join(lines)), file=out, flush=True)
    if stop_line is not None:
        print(printable(stop_line), file=err, flush=True)


def _report(run_dir: Path) -> dict | str:
    """The run's report (report.hotspots with the trainer's advice), or the line saying why there is none."""
    from profiler import report
    from dflash.advice import ADVICE

    try:
        return report.hotspots(run_dir, advice=ADVICE)
    except Exception as e:   # the run is over and its logs are written: the summary never fails it
        return f"verdict: not available ({type(e).__name__}: {e})"


def _handed(on_report, rep: dict, last_step: int) -> list[str]:
    """on_report(rep, last_step: the run_ends' last step): what it wrote, one line each; a failure is one line too
    (the run is over)."""
    try:
        return [f"run view: {path}" for path in on_report(rep, last_step) or ()]
    except Exception as e:   # noqa: BLE001 - a sink's library failing at the end never fails the run
        return [f"run view: not written ({type(e).__name__}: {e})"]


def verdict_and_findings(rep: dict, top: int = TOP_FINDINGS) -> list[str]:
    """The verdict with the windows it was read over and its evidence, then the first `top` findings with
    their next experiment."""
    v = rep["verdict"]
    over = "; ".join(f"{role}: {r['window']}, {r['wall_seconds']:.0f} s" for role, r in v["roles"].items())
    lines = [f"verdict ({over or 'no intervals'}): {v['verdict'] or 'none'}", *(f"  {e}" for e in v["evidence"])]
    found = rep["findings"]
    if not found:
        return lines + ["findings: none"]
    lines.append(f"top findings ({min(top, len(found))} of {len(found)}):")
    for i, f in enumerate(found[:top], 1):
        lines += [f"  {i}. {f['summary']}", f"     next: {f['next']}"]
    return lines


def format_duration(seconds: float) -> str:
    """`42.1 s`, `3 min 18 s`, `2 h 05 min`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
