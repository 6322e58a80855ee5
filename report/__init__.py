"""`dflash-report`'s facade: a run directory in, the report's answers out, each usable from Python.

    hotspots(run_dir, top=None, n_gpus=None) -> dict   every analysis of one run (docs/REPORT.md)
    compare(run_dir_a, run_dir_b) -> dict               the A/B table (exporters.compare)
    plot(run_dir, png_path) -> str                      span time, tokens/s and headroom over time
    format_hotspots(report) / format_compare(table)     the human text of either
Each analysis is one function in exporters.analysis, exporters.memory_events, exporters.advice,
exporters.findings, exporters.rings or exporters.compare, taking a loaded run (exporters.runs.load_run). Standard library
only; matplotlib is imported by the plot alone. A run directory the report cannot read raises ReportError.
"""
from __future__ import annotations

from exporters import compare as _compare
from exporters.advice import memory_margin, split
from exporters.analysis import bandwidth, rank_table, span_ranking, verdict
from exporters.findings import findings
from exporters.memory_events import events, headroom, hot_frames
from exporters.plot import plot_run
from exporters.rings import transfer_rings
from exporters.report_text import format_compare, format_hotspots
from exporters.runs import ReportError, Run, load_run, paused_gc

REPORT_SCHEMA = 1

__all__ = ["REPORT_SCHEMA", "ReportError", "hotspots", "hotspots_of", "compare", "plot", "format_hotspots",
           "format_compare", "load_run"]


def hotspots_of(run: Run, top: int | None = None, n_gpus: int | None = None) -> dict:
    """Every analysis of a loaded run, then the findings drawn from them."""
    ranks = rank_table(run)
    starts = [s for log in run.ranks.values() for s in log.run_starts]
    report = {
        "report_schema": REPORT_SCHEMA, "run_dir": run.run_dir,
        "run_id": next((s["run_id"] for s in starts if s.get("run_id")), None),
        "log_schema": max((s.get("schema", 0) for s in starts), default=None),
        "segments": max((len(log.run_starts) for log in run.ranks.values()), default=0),
        "config": run.config,
        "spans": span_ranking(run, top), "verdict": verdict(run), "bandwidth": bandwidth(run),
        "memory": headroom(run), "events": events(run), "transfer_rings": transfer_rings(run),
        "hot_frames": hot_frames(run), "ranks": ranks,
        "split": split(run, n_gpus, ranks["ranks"]), "memory_margin": memory_margin(run),
    }
    report["findings"] = findings(report)
    return report


def hotspots(run_dir, top: int | None = None, n_gpus: int | None = None) -> dict:
    with paused_gc():
        return hotspots_of(load_run(run_dir), top, n_gpus)


def compare(run_dir_a, run_dir_b) -> dict:
    with paused_gc():
        return _compare.compare(load_run(run_dir_a), load_run(run_dir_b))


def plot(run_dir, png_path) -> str:
    return plot_run(load_run(run_dir), png_path)
