"""The transfer protocol across real gloo processes: 2 targets feeding 1 drafter, ordering per producer,
payload integrity for every dtype, bounded in-flight, STOP/END shutdown with draining."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from dflash import transfer
from dflash.topology import Topology


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(src: int, i: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(src * 1000 + i)
    return torch.randn(7 + i, 5, generator=g).to(dtype)


def _worker(rank: int, world: int, port: int, steps: int, stop_after: int | None, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    topo = Topology(num_targets=world - 1, num_drafters=1)
    ctrl = dist.new_group(backend="gloo")
    try:
        if topo.role(rank) == "target":
            stop = transfer.StopSignal(topo.drafter_of(rank), ctrl)
            sender = transfer.Sender(topo.drafter_of(rank), ctrl, max_in_flight=2, device_payload=False)
            sent = 0
            for i in range(topo.quota(rank, steps)):
                if stop.requested():
                    break
                sender.acquire()
                dtype = [torch.float32, torch.bfloat16, torch.float16][i % 3]
                meta = torch.tensor([[rank, i, 3], [4, 5, 6]], dtype=torch.int64)
                sender.submit(transfer.Message(_payload(rank, i, dtype), meta, [i, rank * 10]))
                sent += 1
            sender.close()
            stop.wait()
            out.put(("target", rank, sent, sender.sent))
        else:
            rx = transfer.Receiver(topo.producers_of(rank), ctrl, torch.device("cpu"), device_payload=False)
            seen: dict[int, list[int]] = {}
            ok = True
            for _ in range(stop_after if stop_after is not None else steps):
                msg = rx.get()
                i = msg.ints[0]
                seen.setdefault(msg.src, []).append(i)
                dtype = [torch.float32, torch.bfloat16, torch.float16][i % 3]
                ok &= torch.equal(msg.payload, _payload(msg.src, i, dtype))
                ok &= msg.meta[0].tolist() == [msg.src, i, 3] and msg.ints[1] == msg.src * 10
            transfer.send_stop(topo.producers_of(rank), ctrl)
            dropped = rx.drain()
            out.put(("drafter", rank, seen, bool(ok), dropped))
    finally:
        dist.destroy_process_group()


def _run(ctx, world: int, steps: int, stop_after: int | None):
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, steps, stop_after, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [out.get(timeout=5) for _ in procs]


def test_two_producers_one_drafter_delivers_everything_in_order(rank_processes):
    results = _run(rank_processes, world=3, steps=9, stop_after=None)
    drafter = next(r for r in results if r[0] == "drafter")
    _, _, seen, ok, dropped = drafter
    assert ok, "a payload or its metadata arrived corrupted"
    assert dropped == 0
    # quotas 5 + 4, each producer's batches in its own order
    assert sorted(len(v) for v in seen.values()) == [4, 5]
    assert all(v == list(range(len(v))) for v in seen.values())


def test_stop_mid_stream_drains_and_every_process_exits(rank_processes):
    results = _run(rank_processes, world=3, steps=100_000, stop_after=3)
    drafter = next(r for r in results if r[0] == "drafter")
    targets = [r for r in results if r[0] == "target"]
    _, _, seen, ok, dropped = drafter
    assert ok
    received = sum(len(v) for v in seen.values())
    # Everything a target sent was either consumed or drained, and STOP cut both quotas short.
    assert received == 3
    assert received + dropped == sum(t[3] for t in targets)
    assert all(t[2] < 50_000 for t in targets)


def test_quota_splits_steps_among_producers():
    topo = Topology(num_targets=5, num_drafters=3)
    assert topo.target_ranks == [3, 4, 5, 6, 7]
    assert topo.producers_of(0) == [3, 6] and topo.producers_of(2) == [5]
    for d in topo.drafter_ranks:
        assert sum(topo.quota(t, 101) for t in topo.producers_of(d)) == 101


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staged_view_round_trips(dtype):
    x = torch.randn(3, 4).to(dtype)
    buf = torch.empty(1024, dtype=torch.uint8)
    v = transfer.staged_view(buf, x)
    v.copy_(x)
    assert torch.equal(transfer.staged_view(buf, x), x)


def test_fingerprint_attributes_pack_or_transfer():
    h = torch.randn(64, 8, dtype=torch.bfloat16)
    sent = transfer.fingerprint(h)
    assert sent[0].item() == h.numel()
    assert transfer.fingerprint_flags(sent, transfer.fingerprint(h.clone()), h.numel()).tolist() == [False, False]
    changed = h.clone()
    changed[3, 1] += 1
    assert transfer.fingerprint_flags(sent, transfer.fingerprint(changed), h.numel()).tolist() == [False, True]
    assert transfer.fingerprint_flags(sent, transfer.fingerprint(h * float("nan")), h.numel()).tolist() == [False, True]
    packed_bad = h.clone()
    packed_bad[0, 0] = float("inf")
    bad_fp = transfer.fingerprint(packed_bad)
    assert bad_fp[0].item() == h.numel() - 1
    assert transfer.fingerprint_flags(bad_fp, transfer.fingerprint(packed_bad.clone()), h.numel()).tolist() == [True, False]


def test_fingerprint_temporaries_stay_bounded_whatever_the_payload_size(monkeypatch):
    """A float64 sum casts its input; chunking keeps that temporary to a chunk, and the result equals
    the one-shot count and sum."""
    monkeypatch.setattr(transfer, "FINGERPRINT_CHUNK_ELEMENTS", 1 << 16)
    t = torch.randn(1 << 20).to(torch.bfloat16)
    t[12345] = float("inf")
    with torch.profiler.profile(profile_memory=True) as prof:
        fp = transfer.fingerprint(t)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert biggest <= 8 * (1 << 16), biggest          # one chunk's float64 copy, not 8 MiB for the whole
    assert fp[0] == (1 << 20) - 1 and torch.isinf(fp[1])
    finite = t[torch.isfinite(t)]
    chunked = transfer.fingerprint(finite)
    assert torch.isclose(chunked[1], finite.sum(dtype=torch.float64), rtol=1e-12)
    assert transfer.fingerprint(torch.empty(0)).tolist() == [0.0, 0.0]
