"""Weights & Biases: each rank's fold samples as one W&B run, in the run's group, written under RUN_DIR/wandb/.

One W&B run per rank (name `rank{R}-{role}`, job type the role, group the run id, project WANDB_PROJECT else
`dflash`), in `RUN_DIR/wandb/{offline-,}run-*/` (wandb's own folder under the run directory, its `dir`).
Its history holds the same scalars as TensorBoard, under the same tags (exporters/tensorboard.py: `interval/KEY
[/LABEL]` for an interval's gauges, `run/KEY[/LABEL]` for run totals), each record's in one row at the record's
training step, which `train/step` repeats as the charts' x-axis. The build information and the training config of
each run_start go to the run's config, the run_end's status and step to its summary.

Mode, so that a run never waits at a login prompt: WANDB_MODE where set (wandb reads it); else online where
credentials are configured (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a netrc entry for WANDB_BASE_URL's host,
default api.wandb.ai, as `wandb login` writes), leaving the choice to wandb and its settings files; else offline:
`wandb sync RUN_DIR/wandb/offline-run-*` uploads the runs later.
"""
from __future__ import annotations

import math
import netrc
import os
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

from exporters.fold import Buckets, Fold, Sample
from exporters.tensorboard import NOT_SCALARS, tag
from profiler.schema import views

PACKAGE = "wandb"
"""The library the sink needs (pip install wandb, or the package's `wandb` extra)."""
STEP_KEY = "train/step"
"""The history key every row carries: the training step it was logged at, the x-axis of every tag."""


def credentials_configured(env=os.environ) -> bool:
    """Whether wandb would find credentials without prompting: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a
    netrc entry (NETRC, else ~/.netrc or ~/_netrc) for the host of WANDB_BASE_URL (default api.wandb.ai)."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    named = env.get("NETRC")
    paths = [Path(named).expanduser()] if named else [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in paths:
        if path.is_file():
            try:
                return netrc.netrc(str(path)).authenticators(host) is not None
            except (OSError, netrc.NetrcParseError):
                return False
    return False


def init_mode(env=os.environ) -> str | None:
    """The `mode` given to wandb.init: None (wandb decides: WANDB_MODE, its settings files, online) where
    WANDB_MODE is set or credentials are configured, else "offline" (no login prompt, no network)."""
    return None if env.get("WANDB_MODE") or credentials_configured(env) else "offline"


class WandbExporter:
    """Scalars of every record's fold samples as one W&B run per rank (the module doc)."""

    name = "wandb"

    def __init__(self, run_dir, rank: int, role: str, run_id: str | None = None):
        import wandb

        run_id = run_id or Path(run_dir).name
        self.root = Path(run_dir) / "wandb"   # where wandb.init(dir=RUN_DIR) writes
        self.root.mkdir(parents=True, exist_ok=True)
        # reinit="create_new": each rank of one process (tests, a single-process launcher) gets its own run
        # instead of finishing the one before it; console="off": the training's own output stays as it is.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash"), group=run_id,
                              name=f"rank{rank}-{role}", job_type=role, dir=str(run_dir), mode=init_mode(),
                              config={"rank": rank, "role": role, "run_id": run_id}, reinit="create_new",
                              settings=wandb.Settings(console="off", quiet=True))
        self.run.define_metric(STEP_KEY)
        for window in ("interval", "run"):
            self.run.define_metric(f"{window}/*", step_metric=STEP_KEY)
        self._fold = Fold()
        self._step = 0           # the training step of the last record that had one
        self._logged_step = -1   # the highest step logged to W&B (its history only goes forward)

    def export(self, record: dict) -> None:
        """Fold one record and log its scalars as one history row; a run_start's build and config go to the
        run's config, a run_end's status to its summary."""
        rec = views.view(record)
        step = rec.step if isinstance(rec, (views.Interval, views.Tick)) else None
        if step is not None:
            self._step = step
        row = {}
        for sample in self._fold(rec):
            value = _scalar(sample)
            if value is not None:
                row[tag(sample)] = value
        if row:
            # W&B drops a row whose step is below one already logged: a record from an earlier step (a resumed
            # segment starting over) is logged at the highest step so far, where its values replace that row's.
            self._logged_step = max(self._logged_step, self._step)
            self.run.log({**row, STEP_KEY: self._logged_step}, step=self._logged_step)
        if isinstance(rec, views.RunStart):
            self.run.config.update(_build_config(rec), allow_val_change=True)
        elif isinstance(rec, views.RunEnd):
            self.run.summary.update({"run_end/status": rec.status, "run_end/step": self._step})

    def close(self, timeout_s: float) -> None:
        """Finish the run (flush its rows to RUN_DIR/wandb and, online, upload them), waiting at most timeout_s:
        run.finish() takes no timeout of its own, so it runs on a daemon thread; one that outlasts timeout_s
        (an upload) is left to wandb's exit hook, bounded by WANDB_FINISH_TIMEOUT where set."""
        finish_within(self.run, timeout_s, f"run {self.run.name}", self.root)


def finish_within(run, timeout_s: float, what: str, root: Path) -> None:
    """run.finish() on a daemon thread, waited for at most timeout_s (it takes no timeout of its own); one line
    on stderr naming `what` and where its data is when it outlasts that."""
    finisher = threading.Thread(target=run.finish, name="wandb-finish", daemon=True)
    finisher.start()
    finisher.join(max(0.0, timeout_s))
    if finisher.is_alive():
        print(f"wandb: {what} did not finish within {timeout_s:g} s; its data is in {root}", file=sys.stderr,
              flush=True)


def _scalar(sample: Sample) -> float | None:
    """The sample's value as a scalar TensorBoard would write too, else None (times, labels, histograms, an ended
    series, an infinity); a non-finite training scalar is NaN, as the fold gives it."""
    value = sample.value
    if sample.family.key in NOT_SCALARS or value is None or isinstance(value, Buckets):
        return None
    value = float(value)
    return None if math.isinf(value) else value


def _build_config(start) -> dict:
    """A run_start's (views.RunStart) versions and device under `build`, its training config under `train`."""
    said = (("run_id", start.run_id), ("hostname", start.hostname), ("device", start.device),
            ("device_name", start.device_name), ("torch_version", start.torch_version), ("version", start.version),
            ("schema", start.schema), ("world_size", start.world_size))
    out = {"build": {key: value for key, value in said if value is not None}}
    if start.config:
        out["train"] = dict(start.config)
    return out
