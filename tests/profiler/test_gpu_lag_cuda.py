"""The always-on GPU classification (profiler/gpu_lag.py) on a real GPU (skipped without one): a span launching
~200 tiny kernels is launch-bound, one queueing a few large matmuls without a sync is GPU-bound."""
import time

import pytest
import torch

import profiler
from profiler.schema.windows import gpu_bound
from tests.profiler.build import make_profiler

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPEATS = 6


def test_tiny_kernels_read_launch_bound_and_queued_matmuls_gpu_bound(tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    small = torch.zeros(64, device=dev)
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(3):                 # warm-up: cuBLAS handle and kernels loaded before any span
        small.add_(1.0)
        big @ big
    torch.cuda.synchronize()           # the test's own sync, before the profiler exists
    with make_profiler(tmp_path, device=dev, control=False, floors={}, interval_s=3600.0, background=False) as prof:
        prof.collector.poll()          # records the first anchor
        time.sleep(0.02)
        prof.collector.poll()          # resolves it (query()) and records the next
        time.sleep(0.02)               # the spans begin well after an anchor
        for _ in range(REPEATS):
            with profiler.span("k.tiny"):
                for _ in range(200):
                    small.add_(1.0)    # ~2 us of GPU work each, launched in ~5-10 us: the GPU keeps pace
            torch.cuda.synchronize()   # the test's own sync: the next span begins on an idle stream
            with profiler.span("k.matmul"):
                for _ in range(4):
                    big @ big          # ~3 ms each on H100 (fp32), queued in microseconds
            torch.cuda.synchronize()   # the test's own sync
        rec = prof.close_interval()
    tiny, mm = rec["spans"]["k.tiny"], rec["spans"]["k.matmul"]
    assert tiny["gpu_lag"]["n"] == mm["gpu_lag"]["n"] == REPEATS, (tiny["gpu_lag"], mm["gpu_lag"])
    assert gpu_bound([tiny])["class"] == "launch-bound", tiny["gpu_lag"]
    assert gpu_bound([mm])["class"] == "GPU-bound", mm["gpu_lag"]
    assert abs(tiny["gpu_lag"]["start_lag_p50_s"]) < 1e-3 and abs(tiny["gpu_lag"]["end_lag_p50_s"]) < 1e-3
    assert mm["gpu_lag"]["end_lag_p50_s"] > 0.5 * mm["gpu"]["p50_seconds"]
