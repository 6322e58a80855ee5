"""Bandwidth floors: what this machine's copies achieve at best, measured once at profiler start (well under
a second), so a span that declares its bytes (`span("d2h_copy", bytes=n)`) reads as a share of its floor.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

logger = logging.getLogger("profiler")

DEVICE_COPY_BYTES = 256 * 2**20  # large enough to defeat the L2 cache (50-60 MiB on H100/H200)
PINNED_COPY_BYTES = 64 * 2**20  # pinned allocation costs ~0.7 s/GiB: keep it small
HOST_COPY_BYTES = 64 * 2**20
CUDA_REPS = 5
HOST_MAX_REPS = 5


def _host_copy_bytes_per_s(budget_s: float, clock=time.perf_counter) -> float:
    """Best of a few CPU tensor copies, counting bytes read + written."""
    src = torch.ones(HOST_COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of dst's pages costs page faults, not bandwidth
    deadline = clock() + budget_s
    best_s = float("inf")
    for _ in range(HOST_MAX_REPS):
        start = clock()
        dst.copy_(src)
        best_s = min(best_s, clock() - start)
        if clock() > deadline:
            break
    return 2 * HOST_COPY_BYTES / best_s


def _cuda_best_seconds(copy_fn, device) -> float:
    """Best time of CUDA_REPS calls of copy_fn, each between its own pair of CUDA events."""
    copy_fn()  # warm-up
    pairs = []
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        for _ in range(CUDA_REPS):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            copy_fn()
            end.record(stream)
            pairs.append((start, end))
        # Deliberate host-device sync, once at profiler start-up only: the floors are needed before
        # the first interval and nothing else is running yet. Never done on the training path.
        pairs[-1][1].synchronize()
    return min(s.elapsed_time(e) for s, e in pairs) / 1000.0


def _device_copy_bytes_per_s(device) -> float:
    src = torch.ones(DEVICE_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _cuda_best_seconds(lambda: dst.copy_(src), device)
    return 2 * DEVICE_COPY_BYTES / seconds  # bytes read + bytes written


def _pinned_bytes_per_s(device) -> dict[str, float]:
    """{"pinned_d2h", "pinned_h2d"}: bytes/s between one pinned host buffer and device memory."""
    host = torch.empty(PINNED_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.ones(PINNED_COPY_BYTES, dtype=torch.uint8, device=device)
    d2h_s = _cuda_best_seconds(lambda: host.copy_(dev, non_blocking=True), device)
    h2d_s = _cuda_best_seconds(lambda: dev.copy_(host, non_blocking=True), device)
    return {"pinned_d2h": PINNED_COPY_BYTES / d2h_s, "pinned_h2d": PINNED_COPY_BYTES / h2d_s}


def measure_floors(device, budget_s: float = 0.5) -> dict[str, float]:
    """Floors in bytes/s: "host_copy"; on CUDA also "device_copy" (read + written), "pinned_d2h" and
    "pinned_h2d" (transferred). A floor that fails to measure is logged and left out; never raises."""
    floors: dict[str, float] = {}
    is_cuda = device is not None and torch.device(device).type == "cuda"
    host_budget_s = budget_s / 4 if is_cuda else budget_s / 2

    def attempt(name: str, fn) -> None:
        try:
            floors.update(fn())
        except Exception as exc:  # noqa: BLE001 - telemetry never kills training
            logger.warning("bandwidth floor %s not measured (logged once): %s: %s", name, type(exc).__name__, exc)

    attempt("host_copy", lambda: {"host_copy": _host_copy_bytes_per_s(host_budget_s)})
    if is_cuda:
        device = torch.device(device)
        attempt("device_copy", lambda: {"device_copy": _device_copy_bytes_per_s(device)})
        attempt("pinned_d2h/pinned_h2d", lambda: _pinned_bytes_per_s(device))
        # The ~0.4 GiB of scratch buffers go back to the driver rather than sit in the allocator's reserved
        # pool for the run, and the peaks reset, so the first interval's peak is the run's, not theirs.
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return floors


def floor_for_span(name: str, floors: dict, is_cuda: bool, path: str | None = None) -> tuple[str, float] | None:
    """(floor name, bytes/s) to compare a span's achieved bandwidth against, or None if unmeasured. On CUDA: a
    span tagged `path="host"` (a device-to-device send staged through pinned host memory) -> host_staged;
    "d2h"/"h2d" in the name -> pinned_d2h/pinned_h2d, else device_copy; on the CPU every copy is host_copy."""
    if is_cuda and path == "host":
        return host_staged_floor(floors)
    way = next((w for w in ("d2h", "h2d") if w in name), None)
    key = "host_copy" if not is_cuda else f"pinned_{way}" if way else "device_copy"
    value = floors.get(key)
    return (key, value) if value is not None else None


def host_staged_floor(floors: dict) -> tuple[str, float] | None:
    """("host_staged", bytes/s): the host path's best end to end, a pinned D2H copy then a pinned H2D copy of the
    same bytes one after the other (1 / (1/d2h + 1/h2d)); None unless both were measured."""
    d2h, h2d = floors.get("pinned_d2h"), floors.get("pinned_h2d")
    if not d2h or not h2d:
        return None
    return "host_staged", 1.0 / (1.0 / d2h + 1.0 / h2d)
