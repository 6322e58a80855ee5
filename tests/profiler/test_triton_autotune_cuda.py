"""The triton.autotune wrapper against real triton and a real GPU (the CPU suite only has a fake
Autotuner): each autotune benchmark of a real `@triton.autotune` kernel becomes a `triton.autotune`
span naming the kernel and its config, and an OOM raised inside an autotune window (as the seeds'
FLA kernel did on a background thread) is an `oom` event that names the span and the kernel."""
from __future__ import annotations

import threading

import pytest
import torch

from profiler.schema.records import read_records
from tests.profiler.build import make_profiler

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch: no triton
    triton = None

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(triton is None or not torch.cuda.is_available(), reason="needs triton and a GPU")]

if triton is not None:
    def _oom_hook(nargs):
        """A config whose pre-hook allocates far beyond the GPU: the autotune window's OOM."""
        torch.empty(1 << 48, dtype=torch.uint8, device="cuda")

    @triton.autotune(configs=[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})], key=["n"])
    @triton.jit
    def dflash_scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)

    @triton.autotune(configs=[triton.Config({"BLOCK": 128}, pre_hook=_oom_hook),
                              triton.Config({"BLOCK": 256}, pre_hook=_oom_hook)], key=["n"])
    @triton.jit
    def dflash_oom_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def _launch(kernel, n: int) -> torch.Tensor:
    x = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    return out


def test_real_autotune_windows_are_spans_and_an_oom_inside_one_names_the_kernel(tmp_path):
    errors = []

    def tune_oom_in_background():
        try:
            _launch(dflash_oom_kernel, 4096)
        except torch.OutOfMemoryError as exc:   # the wrapper tags it; the thread reports it
            errors.append(exc)

    with make_profiler(tmp_path, device=torch.device("cuda"), interval_s=3600.0,
                           control=False, measure_floors=False, detail_steps=5, background=False) as prof:
        prof.set_step(0)
        out = _launch(dflash_scale_kernel, 5000)
        t = threading.Thread(target=tune_oom_in_background, name="autotune-bg")
        t.start()
        t.join()
        torch.cuda.synchronize()   # deliberate: test boundary, before the events are resolved
        prof.set_step(1)
        prof.close_interval()
    assert torch.equal(out, out)   # the tuned kernel ran
    recs, _ = read_records(tmp_path / "profile" / "rank0.jsonl")
    spans = [s for r in recs if r["type"] == "spans" for s in r["spans"] if s["name"] == "triton.autotune"]
    tuned = [s["attrs"] for s in spans if (s.get("attrs") or {}).get("kernel") == "dflash_scale_kernel"]
    assert len(tuned) == 2 and sorted("BLOCK: 128" in a["config"] for a in tuned) == [False, True]
    (exc,) = errors
    assert exc.dflash_span == "triton.autotune" and exc.dflash_kernel == "dflash_oom_kernel"
    assert "during triton.autotune of kernel dflash_oom_kernel" in "".join(exc.__notes__)
