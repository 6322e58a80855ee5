"""Where a rank's start-up goes before its first step: the phases are the gaps between marks from
`dflash-train`'s start (else the rank's process start) to the moment the rank's first step begins (the model
built, a checkpoint loaded, the transfers set up), written as one `startup` event then. Standard library only:
the first mark comes before torch is imported.
"""

from __future__ import annotations

import os
import sys
import time

ENV_LAUNCH_NS = "DFLASH_LAUNCH_UNIX_NS"
"""Unix ns at which the launcher's main() began (set by dflash.launch for its ranks)."""


class StartupTimeline:
    """Marks in time order: (phase name, unix ns at which that phase ended)."""

    def __init__(self, process_start_ns: int, env=None):
        raw = (os.environ if env is None else env).get(ENV_LAUNCH_NS, "")
        launch_ns = int(raw) if raw.isdigit() and int(raw) > 0 else None   # not a number: ignored, never fatal
        self.marks: list[tuple[str, int]] = []
        if launch_ns is not None and launch_ns <= process_start_ns:
            self.origin, self.origin_ns = "launch", launch_ns
            self.marks.append(("spawn", process_start_ns))
        else:
            self.origin, self.origin_ns = "process", process_start_ns

    def mark(self, phase: str, now_ns: int | None = None) -> None:
        """The phase `phase` ends now (or at now_ns)."""
        self.marks.append((phase, time.time_ns() if now_ns is None else now_ns))

    def phases_seconds(self) -> dict[str, float]:
        """Each phase's length in seconds, in order (a phase marked twice adds up)."""
        out: dict[str, float] = {}
        prev = self.origin_ns
        for phase, t in self.marks:
            out[phase] = round(out.get(phase, 0.0) + max(0, t - prev) / 1e9, 4)
            prev = max(prev, t)
        return out

    def fields(self) -> dict:
        """The `startup` event's fields."""
        end = self.marks[-1][1] if self.marks else self.origin_ns
        return {"origin": self.origin, "origin_unix_ns": self.origin_ns,
                "total_seconds": round((end - self.origin_ns) / 1e9, 4), "phases_seconds": self.phases_seconds(),
                "bytecode": bytecode_source()}


LOOP_PHASE = "loop setup"
"""The last phase: from the model's build to the first step (transfers, the throughput meter, data replay)."""


class FirstStep:
    """The end of start-up, handed to the role's loop: `mark(phase)` ends a phase on the way (the model's
    build), `begin()`, as the rank's first step begins, ends the last one (LOOP_PHASE) and hands the timeline's
    fields to `on_done` (the `startup` event and rank 0's line); later calls do nothing."""

    def __init__(self, timeline: StartupTimeline, on_done):
        self.timeline, self.on_done, self.done = timeline, on_done, False

    def mark(self, phase: str) -> None:
        if not self.done:
            self.timeline.mark(phase)

    def begin(self) -> None:
        if self.done:
            return
        self.done = True
        self.timeline.mark(LOOP_PHASE)
        self.on_done(self.timeline.fields())


class NoFirstStep:
    """FirstStep's no-op stand-in (a loop run outside dflash.worker: tests, benchmarks)."""

    def mark(self, phase: str) -> None:
        pass

    def begin(self) -> None:
        pass


def bytecode_source() -> str:
    """Where this process keeps Python bytecode: the cache folder, `beside sources` or `not written`."""
    if sys.pycache_prefix:
        return sys.pycache_prefix
    return "not written" if sys.dont_write_bytecode else "beside sources"


def format_line(fields: dict) -> str:
    """One console line: `start-up 14.4 s from launch to the first step: spawn 0.1, imports 9.8, ...`."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in fields["phases_seconds"].items())
    return f"dflash-train: start-up {fields['total_seconds']:.1f} s from {fields['origin']} to the first step: {parts}"
