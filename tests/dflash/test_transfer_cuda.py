"""The transfer's stream discipline on real GPUs: payloads arrive intact while every stream that could
race is made slow on purpose.

Target side: the forward stream keeps producing and freeing same-sized tensors filled with NaN right
after each submit; on the host path the copy stream is held back by a sleep kernel, so without the
`record_stream` on the copy stream the allocator would hand the packed tensor's memory to the next
"forward" before the D2H copy has read it. NCCL path: the sender must keep the payload alive until
the send has completed, and the drafter is slow to take batches, so sends wait for its receives.
Drafter side: the drafter's stream sleeps before reading each payload and comparing its fingerprint,
so without `wait_ready`'s `record_stream` (on the payload and on the fingerprint) the receiver's next
allocation would reuse the memory under it: a corrupted payload, or a false `payload.transfer` flag.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash import transfer

pytestmark = pytest.mark.cuda

STEPS = 8
SHAPE = (5, 2048, 1024)       # [K, N, H] bf16: 20 MiB per message
SLEEP_CYCLES = 20_000_000     # about 10 ms of GPU time per sleep kernel on an H200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(i: int, device) -> torch.Tensor:
    """Small integers, exact in bf16, different for every message."""
    n = SHAPE[0] * SHAPE[1] * SHAPE[2]
    return ((torch.arange(n, device=device) + 7 * i) % 251).to(torch.bfloat16).view(SHAPE)


def _target(device, device_payload: bool, ctrl) -> None:
    staging = transfer.Staging(device, device_payload, count=3)
    sender = transfer.Sender(0, ctrl, max_in_flight=2, device_payload=device_payload,
                             device=device)
    for i in range(STEPS):
        sender.acquire()
        torch.cuda._sleep(SLEEP_CYCLES)           # a "forward": the CPU runs ahead of the GPU
        hidden = _payload(i, device)
        if staging.copy_stream is not None:
            with torch.cuda.stream(staging.copy_stream):
                torch.cuda._sleep(4 * SLEEP_CYCLES)   # hold the D2H copy back
        fingerprint = transfer.fingerprint(hidden)
        payload, ready, release = staging.stage(hidden)
        sender.submit(transfer.Message(payload, torch.zeros(4, 1, dtype=torch.int64), [i],
                                       ready=ready, release=release, fingerprint=fingerprint))
        del hidden, payload, fingerprint
        for _ in range(3):   # the next "forward" reuses whatever memory the allocator gives back
            torch.empty(SHAPE, dtype=torch.bfloat16, device=device).fill_(float("nan"))
    sender.close()


def _drafter(device, device_payload: bool, ctrl, out) -> None:
    rx = transfer.Receiver([1], ctrl, device, device_payload, queue_size=1)
    same, flags = [], []
    while (msg := rx.get()) is not None:
        time.sleep(0.02)                          # a slow drafter: the receiver fills its queue
        x = transfer.wait_ready(msg)
        torch.cuda._sleep(4 * SLEEP_CYCLES)       # read the payload long after it arrived
        same.append((x == _payload(msg.ints[0], device)).all())   # on the device, no sync
        flags.append(transfer.fingerprint_flags(msg.fingerprint, transfer.fingerprint(x), x.numel()))
        del msg, x
    # test: one sync at the end
    out.put(([bool(v) for v in torch.stack(same).cpu()], torch.stack(flags).cpu().tolist()))


def _worker(rank: int, port: int, device_payload: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank if device_payload else 0)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device_payload else "gloo", rank=rank, world_size=2)
    ctrl = dist.new_group(backend="gloo")
    try:
        if rank == 1:
            _target(device, device_payload, ctrl)
        else:
            _drafter(device, device_payload, ctrl, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["nccl", "host"])
def test_payloads_survive_slow_streams(path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if path == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("the NCCL path needs two GPUs")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, path == "nccl", out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    same, flags = out.get(timeout=5)
    assert same == [True] * STEPS, f"payloads corrupted in flight: {same}"
    assert flags == [[False, False]] * STEPS, f"fingerprints flagged [packed, transfer]: {flags}"
