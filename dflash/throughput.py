"""The drafter's throughput meter, with or without the profiler: RUN_DIR/throughput/rank{R}.json.

`tokens_per_s`: from the end of warm-up to the end, between two device syncs (it counts batches
queued during warm-up, so it reads high when the target bounds the run). `tail_tokens_per_s`: over
the last half of those steps, from host step-end times: the pipeline's steady rate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


class ThroughputMeter:
    """Call `after_step` after every optimiser step and `finish` once at the end."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device, warm_steps: int, start_step: int):
        self.path = Path(run_dir) / "throughput" / f"rank{rank}.json"
        self.device = device
        self.mark_step = start_step + warm_steps
        self.t0_s: float | None = None
        self.tokens0 = 0
        self.stamps: list[tuple[float, int]] = []   # (step-end time in s, tokens so far) after warm-up

    def _now_s(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # deliberate: twice per run, to time finished work
        return time.perf_counter()

    def after_step(self, step: int, tokens_total: int) -> None:
        if step == self.mark_step:
            self.t0_s, self.tokens0 = self._now_s(), tokens_total
        if self.t0_s is not None:
            self.stamps.append((time.perf_counter(), tokens_total))

    def finish(self, step: int, tokens_total: int) -> None:
        """Write the file; nothing when the run ended before warm-up was over."""
        if self.t0_s is None or step <= self.mark_step:
            return
        seconds = self._now_s() - self.t0_s
        tokens = tokens_total - self.tokens0
        steps = step - self.mark_step
        (t_a, n_a), (t_b, n_b) = self.stamps[len(self.stamps) // 2], self.stamps[-1]
        self.path.parent.mkdir(exist_ok=True)
        self.path.write_text(json.dumps({
            "steps": steps, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "steps_per_s": steps / seconds,
            "tail_steps": len(self.stamps) - 1 - len(self.stamps) // 2,
            "tail_tokens_per_s": (n_b - n_a) / (t_b - t_a) if t_b > t_a else None}) + "\n")
