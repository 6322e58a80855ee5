"""TensorBoard: each rank's fold samples as scalars in RUN_DIR/tensorboard/rank{R}/ (one TensorBoard run per rank,
under the run's one log directory), read by `tensorboard --logdir RUN_DIR/tensorboard`.

The fold's samples (exporters/fold.py) map to scalars; a tag names the sample's window:
- `interval/KEY[/LABEL]`: a gauge of the interval a record closed (tokens/s, shares and wait shares, the exact p95,
  the training scalars, GPU memory and activity); a GPU's label is `gpu<index>`;
- `run/KEY[/LABEL]`: a counter's run total (tokens, steps, span time, events by kind), as of the tick or interval
  that gave it.
Each scalar's step is the record's training step and its wall time the instant the sample describes (its stamp,
else the record's time). Histograms, heartbeats and the end-of-run timestamp are not scalars here; the build
information and the run's end go in as text. The writer is torch's `SummaryWriter` (its event files, flushed at
each tick and interval and at close), on the exporter thread like every sink.
"""
from __future__ import annotations

import math
from pathlib import Path

from exporters.fold import Buckets, Fold, Sample
from profiler.schema import views

NOT_SCALARS = ("heartbeat", "run_end", "build_info")
"""Families whose value is a time or a label set, not a figure to plot over steps."""
PACKAGE = "tensorboard"
"""The library the sink needs (pip install tensorboard, or the package's `tensorboard` extra)."""


def tag(sample: Sample) -> str:
    """`interval/KEY[/LABEL...]` for a gauge, `run/KEY[/LABEL...]` for a counter's run total."""
    family = sample.family
    window = "run" if family.kind == "counter" else "interval"
    labels = [f"gpu{value}" if name == "gpu" else value for name, value in zip(family.labels, sample.labels)
              if name != "UUID"]
    return "/".join([window, family.key, *labels])


class TensorBoardExporter:
    """Scalars of every record's fold samples, in RUN_DIR/tensorboard/rank{rank}/."""

    name = "tensorboard"

    def __init__(self, run_dir, rank: int, role: str, run_id: str | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(run_dir) / "tensorboard" / f"rank{rank}"
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=3600)   # flushed at each tick and interval
        self._fold = Fold()
        self._step = 0
        self._writer.add_text("run/rank", f"rank {rank} ({role}) of run {run_id or Path(run_dir).name}", 0)

    def export(self, record: dict) -> None:
        rec = views.view(record)
        step = rec.step if isinstance(rec, (views.Interval, views.Tick)) else None
        if step is not None:
            self._step = step
        for sample in self._fold(rec):
            self._write(sample, rec.time_unix)
        if isinstance(rec, views.RunStart):
            self._writer.add_text("run/build", _build_text(rec), self._step, walltime=rec.time_unix)
        elif isinstance(rec, views.RunEnd):
            self._writer.add_text("run/end", f"status {rec.status} at step {self._step}", self._step,
                                  walltime=rec.time_unix)
        if isinstance(rec, (views.Interval, views.Tick, views.RunEnd)):   # a live TensorBoard follows the ticks
            self._writer.flush()

    def _write(self, sample: Sample, when: float | None) -> None:
        value = sample.value
        if sample.family.key in NOT_SCALARS or value is None or isinstance(value, Buckets):
            return
        value = float(value)
        if math.isinf(value):
            return
        self._writer.add_scalar(tag(sample), value, self._step, walltime=sample.stamp_unix or when)

    def close(self, timeout_s: float) -> None:
        self._writer.close()


def _build_text(start) -> str:
    """A run_start's (views.RunStart) versions and device, one `key: value` a line."""
    said = (("run_id", start.run_id), ("hostname", start.hostname), ("device", start.device),
            ("device_name", start.device_name), ("torch_version", start.torch_version), ("schema", start.schema))
    return "\n\n".join(f"{key}: {value}" for key, value in said if value is not None)
