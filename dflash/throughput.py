"""A rank's steady-state rate (a drafter's steps, a target's batches), with or without the profiler: RUN_DIR/throughput/rank{R}.json.

`steady_tokens_per_s` is the one definition of a rank's steady rate (docs/REPORT.md, "Windows"): the
tokens of the steps after the warm-up steps, over the wall time from the end of the last warm-up step to
the end of the last step, less the phases inside that window (compilation, checkpoints; evaluation runs
after the last step). The two ends are read after a device sync, so the window holds finished work. The
same fields go into the run log as a `throughput` event, which `dflash-report` and the end-of-run line
read: every surface shows this figure, none recomputes it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

import profiler
from profiler.runlog import is_disk_full

WINDOW = "steady state"


class ThroughputMeter:
    """Call `after_step` after every step (a drafter's optimiser step, a target's batch sent), `phase()` around a phase the loop runs (a checkpoint),
    and `finish` once at the end. `compile_seconds_fn` gives the process's compile seconds so far."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device, role: str, warm_steps: int,
                 start_step: int, compile_seconds_fn=lambda: 0.0):
        self.path = Path(run_dir) / "throughput" / f"rank{rank}.json"
        self.device, self.role = device, role
        self.warm_steps, self.mark_step = warm_steps, start_step + warm_steps
        self.compile_seconds_fn = compile_seconds_fn
        self.t0_s: float | None = None
        self.tokens0 = 0
        self.flops0 = 0.0
        self.compile0_s = 0.0
        self.phases_s = {"ckpt.save": 0.0}
        if warm_steps == 0:   # no warm-up: the window starts with the loop (the meter is made just before it)
            self.t0_s, self.compile0_s = self._now_s(), compile_seconds_fn()

    def _now_s(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # deliberate: twice per run, to time finished work
        return time.perf_counter()

    def after_step(self, step: int, tokens_total: int, model_flops_total: float = 0.0) -> None:
        if step == self.mark_step:
            self.t0_s, self.tokens0, self.compile0_s = self._now_s(), tokens_total, self.compile_seconds_fn()
            self.flops0 = model_flops_total

    def phase(self, name: str, seconds: float) -> None:
        """Leave `seconds` of phase `name` out of the window (only once the window has begun)."""
        if self.t0_s is not None:
            self.phases_s[name] = self.phases_s.get(name, 0.0) + seconds

    def finish(self, step: int, tokens_total: int, model_flops_total: float = 0.0) -> None:
        """Write the file and the `throughput` event; nothing when the run ended before warm-up was over.
        `model_flops_total`: the run's model FLOPs so far (dflash/flops.py), 0 where the loop counts none."""
        if self.t0_s is None or step <= self.mark_step:
            return
        wall_s = self._now_s() - self.t0_s
        phases = {**self.phases_s, "drafter.compile": self.compile_seconds_fn() - self.compile0_s}
        seconds = wall_s - sum(phases.values())
        tokens, flops = tokens_total - self.tokens0, model_flops_total - self.flops0
        out = {"window": WINDOW, "role": self.role, "steady_tokens_per_s": tokens / seconds if seconds > 0 else None,
               "steady_steps_per_s": (step - self.mark_step) / seconds if seconds > 0 else None,
               "steady_tokens": tokens, "steady_steps": step - self.mark_step, "steady_seconds": seconds,
               "window_seconds": wall_s, "phases_seconds": phases, "warmup_steps": self.warm_steps,
               "first_step": self.mark_step + 1, "last_step": step}
        if flops > 0:   # the same window's model FLOPs and their rate: TFLOP/s and MFU on every surface
            out.update(steady_model_flops=flops, steady_model_flops_per_s=flops / seconds if seconds > 0 else None)
        self._write(json.dumps(out) + "\n")
        profiler.event("throughput", **out)

    def _write(self, text: str) -> None:
        """The file whole or not at all; a full disk is handed to the run log (the rank stops and says it)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(exist_ok=True)
            tmp.write_text(text)
            tmp.replace(self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if not is_disk_full(exc):
                raise
            profiler.note_disk_full(OSError(exc.errno, exc.strerror, str(self.path)))
