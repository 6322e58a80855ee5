"""`dflash-report`'s facade, usable from Python: hotspots (every analysis of one run, docs/REPORT.md), compare
(the A/B table), plot (a PNG over time), kernels (a Kineto capture per span), memory (allocator snapshots),
format_hotspots / format_compare / format_kernels / format_memory (their text); ReportError otherwise.
"""
from __future__ import annotations

from report import compare as _compare
from report.advice import memory_margin, split
from report.analysis import bandwidth, rank_table, span_ranking, steady_state, verdict
from report.findings import GENERIC, Advice, findings
from report.flight_recorder import transfer_rings
from report.kernels import format_kernels, kernels
from report.memory_snapshot import format_memory, memory
from report.memory_events import events, headroom, hot_frames
from report.plot import plot_run
from report.report_text import format_compare, format_hotspots
from report.runs import ReportError, Run, load_run, paused_gc

REPORT_SCHEMA = 1

__all__ = ["REPORT_SCHEMA", "Advice", "ReportError", "hotspots", "hotspots_of", "compare", "plot",
           "format_hotspots", "format_compare", "load_run", "kernels", "format_kernels", "memory", "format_memory"]


def hotspots_of(run: Run, top: int | None = None, n_gpus: int | None = None, advice: Advice = GENERIC) -> dict:
    """Every analysis of a loaded run (a JSON-able dict, one key per analysis: docs/REPORT.md), then the
    findings drawn from them, their next experiments said by `advice` (a trainer's: dflash/advice.py)."""
    ranks = rank_table(run)
    steady = steady_state(run)
    starts = [s for log in run.ranks.values() for s in log.run_starts]
    report = dict(
        report_schema=REPORT_SCHEMA, run_dir=run.run_dir,
        run_id=next((s["run_id"] for s in starts if s.get("run_id")), None),
        log_schema=max((s.get("schema", 0) for s in starts), default=None),
        segments=max((len(log.run_starts) for log in run.ranks.values()), default=0), pipeline=run.pipeline,
        empty_logs=run.empty_logs, config=run.config, steady_tokens_per_s=steady["steady_tokens_per_s"], steady=steady,
        spans=span_ranking(run, top), verdict=verdict(run), bandwidth=bandwidth(run),
        memory=headroom(run), events=events(run), transfer_rings=transfer_rings(run), hot_frames=hot_frames(run),
        ranks=ranks, split=split(run, n_gpus, ranks["ranks"]), memory_margin=memory_margin(run), findings=[])
    report["findings"] = findings(report, advice)
    return report


def hotspots(run_dir, top: int | None = None, n_gpus: int | None = None, advice: Advice = GENERIC) -> dict:
    with paused_gc():
        return hotspots_of(load_run(run_dir), top, n_gpus, advice)


def compare(run_dir_a, run_dir_b) -> dict:
    with paused_gc():
        return _compare.compare(load_run(run_dir_a), load_run(run_dir_b))


def plot(run_dir, png_path) -> str:
    return plot_run(load_run(run_dir), png_path)
