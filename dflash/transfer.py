"""Target -> drafter transfer over torch.distributed.

A message is a CPU header and metadata over the gloo control group (no device tensor read on the host)
plus the packed hidden states: device to device over NCCL, or host-staged through reused pinned buffers
(`d2h_copy` -> gloo -> `h2d_copy`), which is also the CPU path. A target has at most `max_in_flight`
messages in transit; a slot is freed only once its send completed, so the buffers live until then.
NCCL sends and receives run on streams of their own, so no transfer queues behind compute.

Shutdown: a target ends with END; a drafter sends STOP to each producer and drains until all ended.
Each rank keeps a ring of its last RING_ENTRIES protocol steps (`dump_flight_recorder()`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import profiler
from dflash.pack import WireHeader

TAG_HEADER, TAG_META, TAG_PAYLOAD, TAG_STOP, TAG_FINGERPRINT = 11, 12, 13, 14, 15
KIND_BATCH, KIND_END = 0, 1
MAX_DIMS = 3              # payload dimensions a frame has slots for ([N, K*H] or [K, N, H])
HEADER_LEN = 3 + MAX_DIMS + 2 + len(WireHeader._fields) + 1   # Frame's int64 slots (Frame.encode)
RING_ENTRIES = 64
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_POLL_SECONDS = 50e-6     # how often the sender thread polls an NCCL work for completion


@dataclass
class Message:
    """One packed batch in transit."""
    payload: torch.Tensor
    """The packed hidden states ([N, K*H] or [K, N, H]); device or CPU."""
    meta: torch.Tensor
    """[rows, N] int64 CPU metadata (dflash.pack.META_FIELDS)."""
    ints: WireHeader = WireHeader(0, 0, 0, 0)
    """The batch's header (dflash.pack.WireHeader); given as up to four ints, they are that header zero-padded."""
    src: int = -1
    """Sender rank (set on receipt)."""
    ready: object = None
    """CUDA event after which the payload is complete (pack or D2H on the target, receive on the drafter)."""
    release: object = None
    """Called once the payload buffer may be reused (after the send completed)."""
    work: object = None
    """NCCL path: the send's work handles, set by Sender.submit()."""
    launched: object = None
    """NCCL path: a threading.Event set once submit() has launched (or failed to launch) the send."""
    fingerprint: object = None
    """[finite count, sum] float64 of the payload as packed, or None."""

    def __post_init__(self):
        self.ints = wire_header(self.ints)


def wire_header(ints) -> WireHeader:
    """`ints` as a WireHeader: one already, or up to len(WireHeader._fields) ints, the missing ones 0 (as the wire
    carries them)."""
    if isinstance(ints, WireHeader):
        return ints
    n = len(WireHeader._fields)
    if len(ints) > n:
        raise ValueError(f"at most {n} header ints, got {len(ints)}")
    return WireHeader._make([*ints, *[0] * (n - len(ints))])


@dataclass(frozen=True)
class Frame:
    """The header every message opens with, over gloo: HEADER_LEN int64 slots, in the order of these fields (a
    shape's unused slots 0). END is a frame of kind KIND_END and nothing else."""
    kind: int
    dtype_index: int = 0
    """The payload's dtype, as its index in _DTYPES."""
    shape: tuple = ()
    """The payload's shape, at most MAX_DIMS dimensions."""
    meta_shape: tuple = (0, 0)
    """The metadata tensor's [rows, N]."""
    ints: WireHeader = WireHeader(0, 0, 0, 0)
    has_fingerprint: bool = False
    """A fingerprint follows the payload."""

    @classmethod
    def of(cls, msg: Message) -> "Frame":
        p = msg.payload
        if p.dim() > MAX_DIMS:
            raise ValueError(f"a payload of at most {MAX_DIMS} dimensions, got shape {tuple(p.shape)}")
        return cls(KIND_BATCH, _DTYPES.index(p.dtype), tuple(p.shape), tuple(msg.meta.shape), msg.ints,
                   msg.fingerprint is not None)

    def encode(self) -> torch.Tensor:
        pad = [0] * (MAX_DIMS - len(self.shape))
        return torch.tensor([self.kind, self.dtype_index, len(self.shape), *self.shape, *pad, *self.meta_shape,
                             *self.ints, int(self.has_fingerprint)], dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> "Frame":
        kind, dtype_index, ndim, *rest = header.tolist()
        shape, rest = rest[:MAX_DIMS], rest[MAX_DIMS:]
        rows, cols, *rest = rest
        *ints, has_fingerprint = rest
        return cls(kind, dtype_index, tuple(shape[:ndim]), (rows, cols), WireHeader._make(ints), bool(has_fingerprint))


# A float64 sum casts its input first (8 bytes per element); chunks bound that temporary to 128 MiB.
FINGERPRINT_CHUNK_ELEMENTS = 1 << 24


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[finite count, sum], float64, on t's device; no host read. Chunked in the same order on both
    sides, so equal bytes give equal sums."""
    parts = [torch.stack([torch.count_nonzero(torch.isfinite(c)).to(torch.float64), c.sum(dtype=torch.float64)])
             for c in t.reshape(-1).split(FINGERPRINT_CHUNK_ELEMENTS)]
    return torch.stack(parts).sum(0) if parts else torch.zeros(2, dtype=torch.float64, device=t.device)


def fingerprint_flags(sent: torch.Tensor, received: torch.Tensor, numel: int) -> torch.Tensor:
    """Bool flags [pack, transfer] on the device: the pack made non-finite values, or the copy or the
    wire changed the payload (equal bytes agree to float64 rounding: 1e-9 relative)."""
    sent = sent.to(received.device, non_blocking=True)
    pack_bad = sent[0] != numel
    moved = (received[0] != sent[0]) | ~torch.isclose(received[1], sent[1], rtol=1e-9, atol=1e-6, equal_nan=True)
    return torch.stack([pack_bad, moved & ~pack_bad])


_RING: collections.deque = collections.deque(maxlen=RING_ENTRIES)


def _ring(kind: str, **fields) -> None:
    _RING.append({"time_unix": time.time(), "kind": kind, "thread": threading.current_thread().name, **fields})


def dump_flight_recorder() -> list:
    """This rank's last RING_ENTRIES protocol steps, oldest first (the `transfer_ring` forensics source)."""
    return list(_RING)


def _event_state(ev) -> str | None:
    return None if ev is None else ("done" if ev.query() else "pending")


def _as_wire(t: torch.Tensor) -> torch.Tensor:
    """Gloo moves bytes; view 16-bit floats as int16 so every dtype travels."""
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _wait_completed(work) -> None:
    """Deliberate host wait, on the sender thread only: a buffer (and its slot) is released only after
    its NCCL transfer has completed."""
    while not work.is_completed():
        time.sleep(_POLL_SECONDS)


def _bind_device(device: torch.device | None) -> None:
    """Bind this thread to the rank's CUDA device and a stream of its own: a new thread starts on
    device 0's default stream, where its NCCL ops would queue behind the compute."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


class PinnedPool:
    """Reused pinned host buffers for the host-staged path (pinning is slow: never per batch)."""

    def __init__(self, count: int, round_bytes: int = 16 << 20):
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._count, self._round_bytes, self._made = count, round_bytes, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._free.empty() and self._made < self._count:
                self._made += 1
                return self._alloc(nbytes)
        buf = self._free.get()
        return buf if buf.numel() >= nbytes else self._alloc(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // self._round_bytes) * self._round_bytes
        return torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def staged_view(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A view of a byte buffer with `like`'s dtype and shape."""
    n = like.numel() * like.element_size()
    return buf[:n].view(like.dtype).view(like.shape)


class Staging:
    """(payload, ready event, release callback) for a packed batch: NCCL and CPU send the tensor itself;
    host-staged copies it (`d2h_copy`) into a pinned buffer on a copy stream of its own."""

    def __init__(self, device: torch.device, device_payload: bool, count: int):
        on_gpu = device.type == "cuda"
        self._host_staged = on_gpu and not device_payload
        self._nccl = on_gpu and device_payload
        self._pool = PinnedPool(count) if self._host_staged else None
        self.copy_stream = torch.cuda.Stream(device) if self._host_staged else None

    def stage(self, hidden: torch.Tensor):
        if self._nccl:
            return hidden, _record_event(), None
        if not self._host_staged:
            return hidden, None, None
        nbytes = hidden.numel() * hidden.element_size()
        buf = self._pool.take(nbytes)
        view = staged_view(buf, hidden)
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream), profiler.span("d2h_copy", bytes=nbytes):
            view.copy_(hidden, non_blocking=True)
            ready = _record_event()
        hidden.record_stream(self.copy_stream)
        return view, ready, (lambda b=buf: self._pool.give(b))


class Sender:
    """Target side: `acquire()` a slot, `submit()` a message (NCCL: launched there, the only thread that
    calls NCCL); the sender thread sends header and metadata, waits for the send, frees the slot."""

    def __init__(self, dst: int, ctrl_group, max_in_flight: int, device_payload: bool,
                 device: torch.device | None = None):
        self.dst, self._ctrl, self._device = dst, ctrl_group, device
        self._flow = f"{dist.get_rank()}:"   # + batch index: the trace's arrow to the drafter's recv
        self._device_payload = device_payload
        self._stream = torch.cuda.Stream(device) if device_payload and device is not None else None
        self._slots = threading.Semaphore(max_in_flight)
        self._q: queue.Queue[Message | None] = queue.Queue()
        self._error: BaseException | None = None
        self.sent = 0
        self.in_flight = 0   # slots taken (for the flight recorder; read without a lock)
        profiler.register_forensics("transfer_ring", dump_flight_recorder)
        self._thread = threading.Thread(target=self._run, name="target.sender", daemon=True)
        self._thread.start()

    def acquire(self) -> None:
        self._slots.acquire()   # a failed sender thread releases one, so this returns and _check() raises
        self.in_flight += 1
        _ring("slot_acquired", dst=self.dst, in_flight=self.in_flight, sent=self.sent)
        self._check()

    def submit(self, msg: Message) -> None:
        self._check()
        _ring("submit", dst=self.dst, batch=msg.ints.batch_index, ready=_event_state(msg.ready), queued=self._q.qsize())
        if not self._device_payload:
            self._q.put(msg)
            return
        # Queue first: NCCL sets up its two-rank communicator lazily inside the first isend, which
        # waits for the drafter's first receive, which waits for the sender thread's handshake.
        msg.launched = threading.Event()
        self._q.put(msg)
        try:
            msg.work = self._launch(msg)
        finally:
            msg.launched.set()

    def _launch(self, msg: Message):
        """Enqueue the NCCL send right after the pack, before the next forward's kernels; the span's
        events bracket the transfer (work.wait() orders the stream, it does not block the host)."""
        if msg.ready is not None:
            self._stream.wait_event(msg.ready)
        with torch.cuda.stream(self._stream), \
                profiler.span("transfer.send", bytes=msg.payload.numel() * msg.payload.element_size()):
            # detail: the trace keeps this send when it keeps the batch.
            profiler.tag(flow=self._flow + str(msg.ints.batch_index), detail=msg.ints.detail == 1)
            # nan@transfer.send: the corrupted copy is made on this stream and kept by msg until sent.
            msg.payload = profiler.corrupt("transfer.send", msg.payload, step=msg.ints.batch_index)
            works = [dist.isend(msg.payload, self.dst)]
            if msg.fingerprint is not None:
                works.append(dist.isend(msg.fingerprint, self.dst))
            for work in works:
                work.wait()
        return works

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"target.sender thread failed: {self._error!r}") from self._error

    def _handshake(self, msg: Message) -> None:
        """Header and metadata over gloo: blocks while the drafter's queue is full (back-pressure, kept
        out of `transfer.send`, which would otherwise read as a slow link)."""
        dist.send(Frame.of(msg).encode(), self.dst, group=self._ctrl, tag=TAG_HEADER)
        dist.send(msg.meta, self.dst, group=self._ctrl, tag=TAG_META)
        _ring("header_sent", dst=self.dst, batch=msg.ints.batch_index, shape=list(msg.payload.shape))

    def _send_device(self, msg: Message) -> None:
        self._handshake(msg)
        msg.launched.wait()
        if msg.work is None:
            raise RuntimeError("the NCCL send was never launched (submit() failed)")
        for work in msg.work:
            _wait_completed(work)

    def _send_host(self, msg: Message) -> None:
        if msg.ready is not None:
            # Deliberate wait, on this thread only: the staged D2H copy must have landed
            # before gloo reads the pinned buffer.
            msg.ready.synchronize()
        self._handshake(msg)
        with profiler.span("transfer.send", bytes=msg.payload.numel() * msg.payload.element_size()):
            # as in _launch; path="host": held to the host-staged floor (pinned D2H + H2D), not device_copy
            profiler.tag(flow=self._flow + str(msg.ints.batch_index), detail=msg.ints.detail == 1, path="host")
            payload = profiler.corrupt("transfer.send", msg.payload, step=msg.ints.batch_index)   # nan@transfer.send
            dist.send(_as_wire(payload), self.dst, group=self._ctrl, tag=TAG_PAYLOAD)
        if msg.fingerprint is not None:
            # Deliberate wait, on this thread only (a no-op on the CPU): 16 bytes to the host; the pack
            # that computed them is done, since msg.ready (the staged copy) came after it.
            dist.send(msg.fingerprint.cpu(), self.dst, group=self._ctrl, tag=TAG_FINGERPRINT)

    def _run(self) -> None:
        try:
            _bind_device(self._device)
            while (msg := self._q.get()) is not None:
                (self._send_device if self._device_payload else self._send_host)(msg)
                self.sent += 1
                if msg.release is not None:
                    msg.release()
                _ring("completed", dst=self.dst, batch=msg.ints.batch_index, in_flight=self.in_flight - 1)
                del msg  # drop our reference before freeing the slot: the buffer may now be reused
                self.in_flight -= 1
                self._slots.release()
            dist.send(Frame(KIND_END).encode(), self.dst, group=self._ctrl, tag=TAG_HEADER)
            _ring("end_sent", dst=self.dst, sent=self.sent)
        except BaseException as e:  # surfaced on the main thread at its next acquire/submit/close
            _ring("sender_failed", dst=self.dst, error=repr(e)[:200])
            self._error = e
            self._slots.release()


class StopSignal:
    """Target side: the drafter's STOP, waited on by a thread so `requested()` never blocks (a gloo
    p2p work completes only inside wait())."""

    def __init__(self, drafter: int, ctrl_group):
        self._buf = torch.zeros(1, dtype=torch.int64)
        self._work = dist.irecv(self._buf, drafter, group=ctrl_group, tag=TAG_STOP)
        self._event = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._listen, name="target.stop_listener", daemon=True).start()

    def _listen(self) -> None:
        try:
            self._work.wait()
            _ring("stop_received")
        except BaseException as e:  # a dead drafter: surfaced by wait()
            self._error = e
        self._event.set()

    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise RuntimeError(f"waiting for the drafter's STOP failed: {self._error!r}") from self._error


def _record_event():
    return torch.cuda.current_stream().record_event()


def wait_ready(msg: Message) -> torch.Tensor:
    """Drafter side: the payload, once the current stream waits (on the device) for it; it is
    `record_stream`ed, so the receiver cannot reuse its memory while this stream reads it."""
    if msg.ready is not None:
        stream = torch.cuda.current_stream()
        stream.wait_event(msg.ready)
        for t in (msg.payload, msg.fingerprint):
            if t is not None and t.is_cuda:
                t.record_stream(stream)
    return msg.payload


def send_stop(producers: list[int], ctrl_group) -> None:
    for p in producers:
        dist.send(torch.ones(1, dtype=torch.int64), p, group=ctrl_group, tag=TAG_STOP)
        _ring("stop_sent", dst=p)


class Receiver:
    """Drafter side: a thread receiving from any producer into a bounded queue; `get()` returns the
    next Message, or None once every producer has sent END. Host-staged on a GPU, it receives into
    reused pinned buffers."""

    def __init__(self, producers: list[int], ctrl_group, device: torch.device, device_payload: bool,
                 queue_size: int = 2):
        self.producers, self._ctrl = list(producers), ctrl_group
        self._device, self._device_payload = device, device_payload
        self._pool = PinnedPool(2) if device.type == "cuda" and not device_payload else None
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._ended = False
        profiler.register_forensics("transfer_ring", dump_flight_recorder)
        self._thread = threading.Thread(target=self._run, name="drafter.receiver", daemon=True)
        self._thread.start()

    def qsize(self) -> int:
        return self._q.qsize()

    def get(self) -> Message | None:
        if self._ended:   # every producer has ended: the stream stays ended (drain after a loop that saw it)
            return None
        item = self._q.get()   # the thread's last item is always None or its exception
        if isinstance(item, BaseException):
            raise RuntimeError(f"drafter.receiver thread failed: {item!r}") from item
        self._ended = item is None
        if item is not None:
            # Called inside the caller's `drafter.recv`: link it to the target's `transfer.send`;
            # kept in the detail window when the target kept its send.
            profiler.tag(flow=f"{item.src}:{item.ints.batch_index}", detail=item.ints.detail == 1)
        return item

    def drain(self) -> int:
        """Discard messages until every producer has ended; returns how many were dropped."""
        return sum(1 for _ in iter(self.get, None))

    def _recv_one(self, frame: Frame, src: int) -> Message:
        dtype, shape, ints = _DTYPES[frame.dtype_index], list(frame.shape), frame.ints
        meta = torch.empty(*frame.meta_shape, dtype=torch.int64)
        dist.recv(meta, src, group=self._ctrl, tag=TAG_META)
        fp_device = self._device if self._device_payload else "cpu"
        fp = torch.empty(2, dtype=torch.float64, device=fp_device) if frame.has_fingerprint else None
        if self._device_payload:
            # Allocated on, and received into on, this thread's stream; NCCL's wait() orders the
            # stream after the receive without blocking the host.
            payload = torch.empty(shape, dtype=dtype, device=self._device)
            dist.recv(payload, src)
            if fp is not None:
                dist.recv(fp, src)
            return Message(payload, meta, ints, src, ready=_record_event(), fingerprint=fp)
        # CPU: gloo straight into the tensor the drafter uses. Host-staged on a GPU: gloo into a reused
        # pinned buffer, then h2d_copy on this stream.
        like = torch.empty(shape, dtype=dtype, device="meta")
        nbytes = like.numel() * like.element_size()
        buf = None if self._pool is None else self._pool.take(nbytes)
        staged = torch.empty(shape, dtype=dtype) if buf is None else staged_view(buf, like)
        dist.recv(_as_wire(staged), src, group=self._ctrl, tag=TAG_PAYLOAD)
        if fp is not None:
            dist.recv(fp, src, group=self._ctrl, tag=TAG_FINGERPRINT)
        if buf is None:
            return Message(staged, meta, ints, src, fingerprint=fp)
        with profiler.span("h2d_copy", bytes=nbytes):
            payload = staged.to(self._device, non_blocking=True)
            # 16 pageable bytes: this thread waits for them to be staged, the drafter never does.
            fp = fp.to(self._device) if fp is not None else None
            ready = _record_event()
        # Deliberate wait, on this thread only: the pinned buffer goes back to the pool only after
        # the copy reading it has run (the drafter never waits here).
        ready.synchronize()
        self._pool.give(buf)
        return Message(payload, meta, ints, src, ready=ready, fingerprint=fp)

    def _run(self) -> None:
        try:
            _bind_device(self._device)
            live = set(self.producers)
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            while live:
                # Any source: a slow producer never stalls the others.
                src = dist.recv(header, None, group=self._ctrl, tag=TAG_HEADER)
                frame = Frame.decode(header)
                _ring("header_received", src=src, end=frame.kind == KIND_END, batch=frame.ints.batch_index)
                if src not in live:
                    raise RuntimeError(f"header from rank {src}, which is not a live producer of this drafter")
                if frame.kind == KIND_END:
                    live.discard(src)
                    continue
                msg = self._recv_one(frame, src)
                _ring("received", src=src, batch=msg.ints.batch_index, ready=_event_state(msg.ready),
                      queued=self._q.qsize())
                self._q.put(msg)
            self._q.put(None)
        except BaseException as e:
            _ring("receiver_failed", error=repr(e)[:200])
            self._q.put(e)
