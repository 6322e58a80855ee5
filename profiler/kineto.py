"""torch.profiler for one capture (profiler/capture.py), and the ranges a span opens: a `record_function` while a
capture runs (a user annotation on the CPU track, a `gpu_user_annotation` over its kernels), an NVTX range for
the whole run with `--nvtx` (Nsight Systems and Nsight Compute's `--nvtx-include`)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import warnings
from pathlib import Path

import torch

GZIP_LEVEL = 6   # the default 9 takes about twice as long for a few percent less
# Each capture is one profile object used for one cycle; torch's note that a cycle's end clears its events is
# about reusing one, so it would only add a line to the rank's stderr.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")


def record_function_ranges():
    """(push, pop) of a record_function range, through the ops `torch.profiler.record_function` calls, each under
    DisableTorchFunctionSubclass as it does (without it the op call's torch-function check triples the cost)."""
    enter = torch.ops.profiler._record_function_enter_new.default
    leave = torch.ops.profiler._record_function_exit._RecordFunction
    plain = torch._C.DisableTorchFunctionSubclass

    def push(name):
        with plain():
            return enter(name, None)

    def pop(handle) -> None:
        with plain():
            leave(handle)
    return push, pop


def nvtx_ranges(nvtx=None):
    """(push, pop) of an NVTX range (torch.cuda.nvtx, or a stand-in with range_push/range_pop)."""
    if nvtx is None:
        import torch.cuda.nvtx as nvtx
    push, pop = nvtx.range_push, nvtx.range_pop
    return push, (lambda _depth: pop())


def _every_thread():
    """Record ops on every thread (the receiver's copies, autograd's threads), where this torch can."""
    from torch.profiler import _ExperimentalConfig
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:   # an older torch: ops of the training thread only (kernels are recorded all the same)
        return None


class KinetoSession:
    """One capture's torch.profiler. `begin(step)` before the request's step N prepares it (Kineto's warm-up:
    its one-time set-up, about a second, lands in the step before the capture, not in it), at N starts it;
    `step(n)` moves on to step n (recording `ProfilerStep#n` from N on); `stop(path)` writes the gzip'd Chrome
    trace atomically and returns {"bytes", "activities"}."""

    def __init__(self, request, is_cuda: bool, rank: int, world_size: int, meta: dict):
        from torch.profiler import ProfilerAction, ProfilerActivity, profile
        # Kineto writes its own lines ("USDT: ... profiler_start", STAGE, warnings) to fd 2, the run's stderr,
        # unless its level, read once as it initialises (the first session), is above all of them: 6 (USDT is 5).
        # A capture that fails says so in its own event (profiler/capture.py); a user's KINETO_LOG_LEVEL is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.activities = ["cpu", "cuda"] if is_cuda else ["cpu"]
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
        at = request.at_step
        self.prof = profile(activities=acts, record_shapes=request.shapes, profile_memory=request.memory,
                            with_stack=request.stacks, experimental_config=_every_thread(),
                            schedule=lambda n: ProfilerAction.RECORD if n >= at else ProfilerAction.WARMUP)
        self.at_step, self.rank, self.world_size, self.meta = at, rank, world_size, meta
        self.ranges = record_function_ranges()

    def begin(self, step: int) -> None:
        self.prof.step_num = step   # ProfilerStep#N is our step N
        self.prof.start()
        if step >= self.at_step:
            self._label()

    def step(self, step: int) -> None:
        self.prof.step_num = step - 1   # step() adds one: ProfilerStep#step, whatever steps came before
        self.prof.step()
        if step == self.at_step:
            self._label()

    def _label(self) -> None:
        """The trace's metadata, once it records: who wrote it (HTA reads distributedInfo.rank)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):   # torch adds it itself under a process group
            self.prof.add_metadata_json("distributedInfo", json.dumps(
                {"backend": "none", "rank": self.rank, "world_size": self.world_size}))
        self.prof.add_metadata_json("dflash", json.dumps(self.meta))

    def stop(self, path: Path | None) -> dict:
        # Deliberate host-device sync: torch.profiler's stop synchronizes the device, so every kernel of the
        # captured steps is in the trace. Once per capture, at a step boundary, on the training thread.
        self.prof.stop()
        if path is None:   # stopped while warming up: nothing recorded to keep
            return {}
        path.parent.mkdir(parents=True, exist_ok=True)
        raw, part = path.with_name(path.name + ".raw.json"), path.with_name(path.name + ".part")
        try:
            self.prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(part, "wb", compresslevel=GZIP_LEVEL) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, path)   # a reader never sees half a trace
        finally:
            for leftover in (raw, part):
                leftover.unlink(missing_ok=True)
        return {"bytes": path.stat().st_size, "activities": self.activities}
