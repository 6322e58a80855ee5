"""Bandwidth floors: what this machine's copies achieve at best, measured once at profiler start (well under
a second), so a span that declares its bytes (`span("d2h_copy", bytes=n)`) reads as a share of its floor; and the
compute peaks a rank's model FLOP/s reads against (MFU): the GPU's datasheet dense bf16 peak and the bf16 matmul
rate measured at the same start.
"""

from __future__ import annotations

import contextlib
import logging
import re
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


_DATASHEET = (
    (r"\bH100\b.*\bPCIE\b", 756e12, "datasheet dense bf16 (H100 PCIe)"),
    (r"\bH(100|200)\b.*\b(PCIE|NVL)\b", None, None),     # NVL / PCIe H200: other figures, not known here
    (r"\bH(100|200)\b", 989.4e12, "datasheet dense bf16 (H100/H200 SXM)"),
    (r"\bA100\b", 312e12, "datasheet dense bf16 (A100)"),
)
"""(pattern on the upper-cased device name, FLOP/s, label), first match wins."""
MATMUL_N = 8192
"""The side of the square bf16 matmul timed at start on a GPU (1.1 TFLOP each: about 1.4 ms on an H100)."""
CPU_MATMUL_N = 256
"""The side of the float32 matmul timed at start on the CPU (a few ms; its rate is a CPU's, and labelled so)."""
CPU_MATMUL_REPS = 5


def peak_flops_per_s(device_name: str) -> tuple[float, str] | None:
    """(datasheet dense bf16 peak in FLOP/s, label) for a torch.cuda.get_device_name() string, or None for a GPU
    not known here ("NVIDIA H100 80GB HBM3" and "NVIDIA H200": 989.4e12; "NVIDIA H100 PCIe": 756e12;
    "NVIDIA A100-SXM4-80GB": 312e12)."""
    name = device_name.upper()
    for pattern, flops_per_s, label in _DATASHEET:
        if re.search(pattern, name):
            return None if flops_per_s is None else (flops_per_s, label)
    return None


def measure_matmul_flops_per_s(device, n: int = MATMUL_N, iters: int = 10, dtype=torch.bfloat16) -> float:
    """The best of `iters` n x n x n matmuls on the CPU, of CUDA_REPS between CUDA events on a GPU, in FLOP/s
    (bench/bench_drafter.py's matmul_peak_flops, best instead of mean): a start-up measurement, never on the step
    loop."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cuda":
        return 2 * n ** 3 / _cuda_best_seconds(lambda: a @ b, device)
    a @ b   # warm-up
    best_s = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        a @ b
        best_s = min(best_s, time.perf_counter() - start)
    return 2 * n ** 3 / best_s


def compute_peaks(device, device_name: str) -> dict:
    """{"datasheet": {"flops_per_s", "what"}, "measured": {"flops_per_s", "what"}} of this rank's device, the peaks
    its MFU is read against; a peak not known (a GPU missing from the datasheet table, the CPU's) or that failed to
    measure is left out. Never raises."""
    out = {}
    is_cuda = device is not None and torch.device(device).type == "cuda"
    sheet = peak_flops_per_s(device_name or "") if is_cuda else None
    if sheet is not None:
        out["datasheet"] = {"flops_per_s": sheet[0], "what": sheet[1]}
    n, dtype, kind = (MATMUL_N, torch.bfloat16, "bf16") if is_cuda else (CPU_MATMUL_N, torch.float32, "float32")
    try:
        reps = CUDA_REPS if is_cuda else CPU_MATMUL_REPS
        rate = measure_matmul_flops_per_s(device if is_cuda else "cpu", n, reps, dtype)
        out["measured"] = {"flops_per_s": rate, "what": f"{kind} {n}x{n}x{n} matmul, best of {reps} at the rank's "
                                                        "start"}
    except Exception as exc:  # noqa: BLE001 - telemetry never kills training
        logger.warning("compute peak not measured: %s: %s", type(exc).__name__, exc)
    if is_cuda:
        with contextlib.suppress(Exception):   # the operands go back to the driver, the peaks reset (as the floors'),
            # and cuBLAS's workspace too: allocated by this first matmul, before any memory history began, it would
            # stay the largest live block without a stack; the model's first matmul makes it again, recorded
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return out
