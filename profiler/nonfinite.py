"""Non-finite checks without a host sync.

`NonfiniteMonitor.check(span, step, {name: tensor})` reduces each tensor on the device to one flag and queues
the flags with the current stream. The collector's `poll()` sends the checks queued since its last poll as
one batch (`CudaReadback`: a side stream waits for their streams and copies the flags into a pinned buffer,
an event after the copy) and reads a batch once its event's `query()` says done: nothing waits. A check past
QUEUE_MAX unread ones is counted in `dropped`. Findings go to `on_found` one or two polls after the step;
`settle()` is the deliberate wait for rare points (a checkpoint). On the CPU flags are read where they are.

`check_stats(span, step, {name: tensor})` rides the same path with a row of statistics per tensor instead of a
flag (`tensor_stats`: profiler/numerics.py STATS), handed to `on_stats` when read back: the numerics detector.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time

import torch

from profiler.numerics import NEAR_MAX_BINADES, STATS
from profiler.numerics_kernel import fused_stats

logger = logging.getLogger("profiler")

QUEUE_MAX = 4096      # checks queued and not read back yet, past which a check is dropped (counted)
MAX_FLAGS = 8         # tensors one check may name
BATCH_FLAGS = 4096    # values (flags, statistics) one readback batch carries (the size of its pinned buffer)
BATCHES = 4           # readback batches in flight at once


class CudaReadback:
    """The collector's side of the CUDA checks: one batch per poll, on a side stream, never waiting.
    `stream_of(flags)` runs on the training thread: the stream a device flags tensor was made on (the
    current one, through `current_stream`, the event pool's cached lookup), None for host flags."""

    def __init__(self, device, current_stream):
        self._current = current_stream
        self._side = torch.cuda.Stream(device)
        # Pinned buffers allocated once, here: allocating pinned memory (cudaHostAlloc) can wait for the device.
        # float32: a flag reads back as 0.0 or 1.0, a statistic as itself.
        self._host = [torch.zeros(BATCH_FLAGS, dtype=torch.float32, pin_memory=True) for _ in range(BATCHES)]
        self._ready = [torch.cuda.Event() for _ in range(BATCHES)]   # one "copy landed" event per buffer
        self._free = collections.deque(range(BATCHES))
        self._marks: dict = {}   # stream -> the event the side stream waits on (reused: a wait takes its state then)

    def stream_of(self, flags):
        return self._current() if flags.is_cuda else None

    def available(self) -> bool:
        """A buffer is free for a new batch."""
        return bool(self._free)

    def issue(self, flags: list, streams) -> tuple:
        """Copy the flags (device tensors, in order) to a free pinned buffer behind the work queued so far
        on each of `streams`. Returns the batch's handle: asynchronous enqueues only, no sync."""
        slot = self._free.popleft()
        with torch.cuda.stream(self._side):
            for stream in streams:
                mark = self._marks.get(stream)
                if mark is None:
                    mark = self._marks[stream] = torch.cuda.Event()
                mark.record(stream)
                self._side.wait_event(mark)
            # Flags are 1-D as a rule (a stack of 0-dim checks): a reshape each costs a dispatch. The cast to the
            # buffer's float32 runs here, on the side stream, not on the training thread.
            flat = torch.cat([f if f.dim() == 1 else f.reshape(-1) for f in flags]).to(torch.float32)
            host = self._host[slot][:flat.numel()]
            host.copy_(flat, non_blocking=True)
            self._ready[slot].record(self._side)
        return slot, host, flat, flags

    def done(self, handle) -> bool:
        """The batch's copy has landed (Event.query(): never a wait)."""
        return self._ready[handle[0]].query()

    def read(self, handle) -> list:
        """The batch's flags, once done; its buffer is free again and its tensors let go."""
        values = handle[1].tolist()
        self._free.append(handle[0])
        return values


class NonfiniteMonitor:
    """Device-side checks read back asynchronously; `on_found(finding)` runs on the polling thread for each
    check that flagged something, `first` keeps the first. A finding is a dict: span, step, rank, tensor (the
    first flagged), tensors (all) and the check's fields. `readback`: a `CudaReadback`, None on a CPU run.
    `on_stats(span, step, names, rows, meta)`: each `check_stats` read back (rows: one list of STATS a name)."""

    def __init__(self, rank: int, on_found, *, readback=None, on_stats=None):
        self.rank = rank
        self._on_found = on_found
        self._on_stats = on_stats   # (span, step, names, rows, meta) for each check_stats read back
        self._readback = readback
        self._queued: collections.deque = collections.deque()     # the training threads' checks, not sent
        self._inflight: collections.deque = collections.deque()   # (entries, batch handle or None), in order
        self._inflight_checks = 0
        self.dropped = 0
        self._poll_lock = threading.Lock()
        self.first: dict | None = None
        self.found = 0
        self.checks = 0

    def check(self, span: str, step: int, tensors: dict, **fields) -> None:
        """Flag each tensor that holds a NaN or Inf; never waits for the device."""
        flags = torch.stack([~torch.isfinite(t).all() for t in tensors.values()])
        self.check_flags(span, step, list(tensors), flags, **fields)

    def check_flags(self, span: str, step: int, names: list, flags: torch.Tensor, **fields) -> None:
        """Queue already computed bool flags (one per name, true = bad) for reading back. `flags` must not be
        modified afterwards: on a GPU it is read when the collector's next poll sends it."""
        if len(names) > MAX_FLAGS:
            raise ValueError(f"check {span!r}: at most {MAX_FLAGS} tensors, got {len(names)}")
        if flags.numel() != len(names):   # metadata only: no device read
            raise ValueError(f"check {span!r}: {flags.numel()} flags for {len(names)} names")
        self._queue(span, step, names, flags, 1, fields)

    def check_stats(self, span: str, step: int, tensors: dict, **meta) -> None:
        """Queue each tensor's statistics (`tensor_stats`, reduced on the device: no host sync) for `on_stats`;
        `meta` goes with them (e.g. jump=True), besides each tensor's element count, dtype and log2 of its largest
        finite value. Does nothing without an `on_stats`."""
        if self._on_stats is None or not tensors:
            return
        if len(tensors) > MAX_FLAGS:
            raise ValueError(f"check {span!r}: at most {MAX_FLAGS} tensors, got {len(tensors)}")
        values = list(tensors.values())
        info = torch.finfo(values[0].dtype) if values[0].is_floating_point() else torch.finfo(torch.float32)
        rows = torch.stack([tensor_stats(t) for t in values])
        meta = dict(meta, counts=[t.numel() for t in values], dtype=str(values[0].dtype).removeprefix("torch."),
                    log2_max=math.log2(info.max))
        self._queue(span, step, list(tensors), rows, len(STATS), meta)

    def _queue(self, span: str, step: int, names: list, values, width: int, fields: dict) -> None:
        """A check's device (or host) values, `width` per name, queued for the collector's next poll."""
        self.checks += 1
        if len(self._queued) + self._inflight_checks >= QUEUE_MAX:   # the collector is far behind: never wait
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("profiler: non-finite checks dropped: %d checks not read back yet", QUEUE_MAX)
            return
        stream = self._readback.stream_of(values) if self._readback is not None else None
        self._queued.append((span, step, names, values, stream, fields, width))

    def pending(self) -> int:
        """Checks not read back yet."""
        return len(self._queued) + self._inflight_checks

    def poll(self) -> int:
        """Read back, in order, the batches that landed, send the checks queued since the last poll, and read
        again (host flags are ready at once); returns how many checks were read. Off the training thread."""
        with self._poll_lock:
            read = self._read_landed()
            self._send()
            return read + self._read_landed()

    def _read_landed(self) -> int:
        read = 0
        while self._inflight:
            entries, handle = self._inflight[0]
            if handle is not None and not self._readback.done(handle):
                break
            self._inflight.popleft()
            self._inflight_checks -= len(entries)
            read += len(entries)
            self._report(entries, self._readback.read(handle) if handle is not None else [])
        return read

    def _send(self) -> None:
        """Move the queued checks into batches in flight: each batch at most BATCH_FLAGS device flags; while
        no buffer is free, the rest wait for a later poll."""
        rb, queued = self._readback, self._queued
        while queued:
            if rb is not None and not rb.available():
                return
            entries, device_flags, streams, n = [], [], {}, 0
            while queued:
                entry = queued[0]
                if entry[4] is not None:   # device values, `width` per name (check_flags made sure)
                    size = len(entry[2]) * entry[6]
                    if n + size > BATCH_FLAGS:
                        break
                    n += size
                    device_flags.append(entry[3])
                    streams[entry[4]] = None
                entries.append(queued.popleft())
            try:
                handle = rb.issue(device_flags, list(streams)) if device_flags else None
            except Exception:   # noqa: BLE001 - telemetry never kills training: these checks are counted lost
                self.dropped += len(entries)
                logger.exception("profiler: sending %d non-finite checks to the host failed", len(entries))
                continue
            self._inflight.append((entries, handle))
            self._inflight_checks += len(entries)

    def _report(self, entries: list, device_values: list) -> None:
        """Each check's flags, host ones read directly, device ones in order from the batch's values."""
        at = 0
        for span, step, names, flags, stream, fields, width in entries:
            if stream is None:
                values = flags.reshape(-1).tolist()
            else:
                values, at = device_values[at:at + len(names) * width], at + len(names) * width
            if width > 1:
                self._stats([values[i:i + width] for i in range(0, len(values), width)], span, step, names, fields)
                continue
            bad = [n for n, flag in zip(names, values) if flag]
            if bad:
                self._found(dict(span=span, step=step, rank=self.rank, tensor=bad[0], tensors=bad, **fields))

    def _stats(self, rows: list, span: str, step: int, names: list, meta: dict) -> None:
        try:
            self._on_stats(span, step, names, rows, meta)
        except Exception:   # noqa: BLE001 - telemetry never kills training
            logger.exception("profiler: reading numerics statistics failed")

    def settle(self, timeout_s: float) -> dict | None:
        """Read back every check issued so far, polling Event.query() for up to timeout_s; returns
        `first`. A deliberate wait for the device: for rare points only (a checkpoint, run end)."""
        deadline = time.monotonic() + timeout_s
        self.poll()
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.002)
            self.poll()
        return self.first

    def _found(self, finding: dict) -> None:
        self.found += 1
        if self.first is None:
            self.first = finding
        try:
            self._on_found(finding)
        except Exception:   # noqa: BLE001 - telemetry never kills training; `first` still holds it
            logger.exception("profiler: reporting a non-finite value failed")


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """A tensor's STATS row (profiler/numerics.py), float32 on its device, enqueued only (no host sync): largest
    |x|, 2-norm, counts of |x| within NEAR_MAX_BINADES of the dtype's largest value and of nonzero |x| below its
    smallest normal, and of NaN/Inf. NaN and Inf carry into the absmax and the norm; the count says so."""
    t = t.detach()
    if not t.is_floating_point():
        t = t.float()
    info = torch.finfo(t.dtype)
    fused = fused_stats(t, info.max * 2.0 ** -NEAR_MAX_BINADES, info.tiny)   # one pass on a GPU (Triton)
    return fused if fused is not None else torch_stats(t, info)


def torch_stats(t: torch.Tensor, info) -> torch.Tensor:
    """tensor_stats' row through torch's reductions (a CPU tensor, a small one, a layout the kernel does not read;
    each statistic a pass of its own). `info`: t's dtype's torch.finfo."""
    a = t.abs()
    near = (a > info.max * 2.0 ** -NEAR_MAX_BINADES).sum()
    under = ((a < info.tiny) & (a > 0)).sum()
    bad = torch.isfinite(a).logical_not_().sum()
    absmax = a.amax() if a.numel() else a.new_zeros(())
    norm = torch.linalg.vector_norm(t, dtype=torch.float32)
    return torch.stack([absmax.float(), norm, near.float(), under.float(), bad.float()])


def update_ratio(before: list, params: list) -> torch.Tensor:
    """||after - before|| / ||before|| over every tensor, on the device (a 0-dim float32): the update-to-weight
    ratio of an optimizer step, `before` copies of `params` taken just before it; `before` is overwritten."""
    weight = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(before)]))
    torch._foreach_sub_(before, params)
    update = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(before)]))
    return (update / weight.clamp_min(torch.finfo(torch.float32).tiny)).float()


def step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """optimizer.step(), skipped where the 0-dim flag `bad` is true: a fused optimizer skips on the device
    through its `found_inf` input (as under GradScaler); otherwise the host reads the flag."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = bad.to(torch.float32).reshape(())
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not bool(bad):   # CPU: a memory read; GPU + non-fused: one deliberate host-device sync per step
        optimizer.step()


def make_readback(is_cuda: bool, device, pool):
    """How a rank's checks come back from the device: None on a CPU run. The stream lookup is the event pool's
    cached one, or torch's where a test's pool has no streams."""
    if not is_cuda:
        return None
    current = pool.current if pool is not None and pool.current() is not None else (
        lambda: torch.cuda.current_stream(device))
    return CudaReadback(device, current)
