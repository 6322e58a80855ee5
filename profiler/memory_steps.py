"""Each step's allocator peak beside the sizes the loop says its memory depends on: the history a memory forecast
is fitted to (profiler/report/memory_forecast.py).

The loop names a step's sizes with `profiler.memory_sizes(tokens=..., rows=...)` (any named counts); at the next
step boundary (`set_step`) `StepPeaks.on_step` reads the caching allocator's peak allocated and reserved bytes
since the last boundary from one host call (allocator bookkeeping: no device sync) and resets them, and keeps
(step, peaks, the bytes still allocated once it ended, sizes). A step without sizes keeps its peaks too (a warm-up or evaluation step: the transients of
compilation and autotune are in them). The interval takes the rows (`take()`, on the collector thread): at most
ROWS_PER_INTERVAL a rank, the highest peaks and an even spread of the rest kept, the others counted. Because the
peaks are reset at every boundary, the interval's allocator peaks are the maxima of its steps (`take` hands them
over with the rows) and of the step still running: the collector reads the allocator without resetting it then
(profiler/memory.py `memory_state`).

`NullStepPeaks` on a CPU: nothing is read or kept.
"""
from __future__ import annotations

import threading

ROWS_PER_INTERVAL = 48
"""Step rows an interval keeps per rank (the highest peaks, a quarter of them, and an even spread of the rest)."""
MAX_SIZES = 8
"""Sizes one step may name."""


def _read_and_reset(device_index: int) -> tuple[int, int, int]:
    """(peak allocated, peak reserved, allocated now) bytes, the peaks since the last reset, then reset: the
    allocator's own counters (the nested stats, without torch.cuda.memory_stats' flattening)."""
    import torch
    stats = torch._C._cuda_memoryStats(device_index)
    allocated = stats["allocated_bytes"]["all"]
    out = allocated["peak"], stats["reserved_bytes"]["all"]["peak"], allocated["current"]
    torch._C._cuda_resetPeakMemoryStats(device_index)
    return out


class StepPeaks:
    """The training thread's side (`sizes`, `on_step`) and the collector's (`take`)."""

    def __init__(self, device_index: int, read_and_reset=_read_and_reset):
        self._index = device_index
        self._read = read_and_reset
        self._lock = threading.Lock()
        self._rows: list = []
        self._seen = 0
        self._peaks = (0, 0)    # the interval's maxima so far
        self._sizes: dict = {}
        self._step = None

    def sizes(self, sizes: dict) -> None:
        """The current step's sizes (named non-negative numbers), kept with its peak at the next boundary."""
        if len(sizes) > MAX_SIZES:
            raise ValueError(f"memory_sizes: at most {MAX_SIZES} sizes, got {len(sizes)}")
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"memory_sizes: {name}={value!r} is not a non-negative number")
        self._sizes = dict(sizes)

    def on_step(self, step: int) -> None:
        """A step boundary: the step that ended gets the allocator's peaks since the last boundary."""
        allocated, reserved, after = self._read(self._index)
        ended, sizes = self._step, self._sizes
        self._step, self._sizes = step, {}
        if ended is None or ended == step:   # the first boundary, or the same step set again
            with self._lock:
                self._peaks = (max(self._peaks[0], allocated), max(self._peaks[1], reserved))
            return
        with self._lock:
            self._seen += 1
            self._peaks = (max(self._peaks[0], allocated), max(self._peaks[1], reserved))
            self._rows.append({"step": ended, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
                               "allocated_bytes": after, "sizes": sizes})

    def take(self) -> tuple[dict, tuple[int, int]]:
        """At an interval's close: its `memory.steps` part (docs/RUNLOG.md: its rows, at most ROWS_PER_INTERVAL,
        and how many steps ended in it) and the (peak allocated, peak reserved) bytes of those steps; both start
        again."""
        with self._lock:
            rows, seen, peaks = self._rows, self._seen, self._peaks
            self._rows, self._seen, self._peaks = [], 0, (0, 0)
        return {"rows": thin(rows, ROWS_PER_INTERVAL), "steps": seen}, peaks


def thin(rows: list, keep: int) -> list:
    """At most `keep` rows in step order: the highest peaks (a quarter of `keep`) and an even spread of the rest."""
    if len(rows) <= keep:
        return rows
    top = set(sorted(range(len(rows)), key=lambda i: -rows[i]["peak_allocated_bytes"])[:keep // 4])
    rest = [i for i in range(len(rows)) if i not in top]
    want = keep - len(top)
    spread = {rest[round(k * (len(rest) - 1) / (want - 1))] for k in range(want)} if want > 1 else set(rest[:want])
    return [rows[i] for i in sorted(top | spread)]


class NullStepPeaks:
    """No allocator (a CPU run): nothing read, nothing kept."""

    def sizes(self, sizes: dict) -> None:
        pass

    def on_step(self, step: int) -> None:
        pass

    def take(self) -> None:
        return None


def make_step_peaks(device, is_cuda: bool):
    """StepPeaks on a CUDA device, else the null one."""
    if not is_cuda:
        return NullStepPeaks()
    index = device.index
    if index is None:
        import torch
        index = torch.cuda.current_device()
    return StepPeaks(index)
