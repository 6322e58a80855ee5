"""`dflash-report`'s facade, usable from Python: hotspots (every analysis of one run, docs/REPORT.md), compare
(the A/B table), plot (a PNG over time), kernels (a Kineto capture per span), memory (allocator snapshots),
format_hotspots / format_compare / format_kernels / format_memory (their text); ReportError otherwise.
"""
from __future__ import annotations

import gc
from pathlib import Path

from profiler.schema import views
from profiler.report import compare as _compare
from profiler.report.advice import memory_margin, split
from profiler.report.memory_forecast import memory_forecast, supersede
from profiler.report.analysis import bandwidth, rank_table, span_ranking, steady_state, verdict
from profiler.report.findings import GENERIC, Advice, findings
from profiler.report.flight_recorder import transfer_rings
from profiler.report.kernels import format_kernels, kernels
from profiler.report.memory_snapshot import format_memory, memory
from profiler.report.memory_events import events, headroom, hot_frames
from profiler.report.numerics import numerics
from profiler.report.plot import plot_run
from profiler.report.report_text import format_compare, format_hotspots
from profiler.report.runs import ReportError, Run, load_run, log_stamp, paused_gc

REPORT_SCHEMA = 1

__all__ = ["REPORT_SCHEMA", "Advice", "ReportError", "hotspots", "hotspots_of", "compare", "plot",
           "format_hotspots", "format_compare", "load_run", "kernels", "format_kernels", "memory", "format_memory"]


def hotspots_of(run: Run, top: int | None = None, n_gpus: int | None = None, advice: Advice = GENERIC) -> dict:
    """Every analysis of a loaded run (a JSON-able dict, one key per analysis: docs/REPORT.md), then the
    findings drawn from them, their next experiments said by `advice` (a trainer's: dflash/advice.py)."""
    ranks = rank_table(run)
    steady = steady_state(run)
    starts = [views.run_start(s) for log in run.ranks.values() for s in log.run_starts]
    report = dict(
        report_schema=REPORT_SCHEMA, run_dir=run.run_dir,
        run_id=next((s.run_id for s in starts if s.run_id), None),
        log_schema=max((s.schema or 0 for s in starts), default=None),
        segments=max((len(log.run_starts) for log in run.ranks.values()), default=0), pipeline=run.pipeline,
        empty_logs=run.empty_logs, config=run.config, steady_tokens_per_s=steady["steady_tokens_per_s"], steady=steady,
        spans=span_ranking(run, top), verdict=verdict(run), bandwidth=bandwidth(run),
        memory=headroom(run), events=events(run), numerics=numerics(run), transfer_rings=transfer_rings(run),
        hot_frames=hot_frames(run),
        ranks=ranks, split=split(run, n_gpus, ranks["ranks"]), memory_forecast=memory_forecast(run), findings=[])
    report["memory_margin"] = supersede(memory_margin(run), report["memory_forecast"])
    report["findings"] = findings(report, advice)
    return report


class LastRun:
    """The run hotspots() read last, held for the compare() that may follow (`hotspots RUN --compare BASE` compares
    RUN right after reporting it): handed over for RUN while its logs are unchanged (each rank log's size,
    modification time and inode as before it was read), so a run's logs are read once per command; dropped by
    the compare and by the next hotspots().

    A held run is millions of objects the cyclic collector would otherwise walk again and again once it is back on
    (a second per 100 MB of log): they are frozen out of its sight (gc.freeze) while held, and handed back at the
    drop. The freeze takes every object alive then, so cycles among them wait for the drop to be collected; where
    the process froze objects of its own, no run is held."""

    def __init__(self):
        self._held: tuple | None = None   # (run directory, stamp, Run)

    def keep(self, run_dir, stamp: tuple, run: Run) -> None:
        self.drop()
        if gc.get_freeze_count():   # the process's own frozen objects: a drop must not thaw them
            return
        gc.freeze()
        self._held = (Path(run_dir).resolve(), stamp, run)

    def take(self, run_dir) -> Run | None:
        """The run held for RUN_DIR, unchanged since it was read; else None."""
        held = self._held
        if held is None or held[0] != Path(run_dir).resolve() or held[1] != log_stamp(run_dir):
            return None
        return held[2]

    def drop(self) -> None:
        if self._held is not None:
            self._held = None
            gc.unfreeze()


_LAST = LastRun()


def hotspots(run_dir, top: int | None = None, n_gpus: int | None = None, advice: Advice = GENERIC) -> dict:
    _LAST.drop()
    with paused_gc():
        stamp = log_stamp(run_dir)   # before reading: a log written meanwhile is read again by compare
        run = load_run(run_dir)
        _LAST.keep(run_dir, stamp, run)
        return hotspots_of(run, top, n_gpus, advice)


def compare(run_dir_a, run_dir_b) -> dict:
    """The A/B table of two run directories (report.compare), each read once: the same directory twice, or the one
    hotspots() just read (LastRun), is not read again."""
    with paused_gc():
        try:
            stamp_a = log_stamp(run_dir_a)
            run_a = _LAST.take(run_dir_a) or load_run(run_dir_a)
            same = Path(run_dir_a).resolve() == Path(run_dir_b).resolve() and log_stamp(run_dir_b) == stamp_a
            run_b = run_a if same else _LAST.take(run_dir_b) or load_run(run_dir_b)
        finally:
            _LAST.drop()
        table = _compare.compare(run_a, run_b)
        del run_a, run_b   # freed while the collector is off: it never walks them
    return table


def plot(run_dir, png_path) -> str:
    return plot_run(load_run(run_dir), png_path)
