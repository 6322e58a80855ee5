"""Bare NCCL send/recv between GPU 0 and GPU 1 of the same bytes as a packed batch: the peer that
`transfer.send` is compared with. Also the same bytes through pinned host memory (D2H + H2D).

    python3 bench/nccl_p2p.py --bytes 839000000 [--reps 10] [--gap-seconds 0.25]

With --gap-seconds the GPUs idle that long before each send, as between a pipeline's batches (a send
after idle time is slower: bench/RESULTS.md). The ranks line up over NCCL before each send (a barrier,
an all-reduce over the link), then each transfer is timed alone by CUDA events on the receiver.
Prints one JSON line: {"bytes":..,"nccl_seconds":..,"nccl_bytes_per_s":..,"pinned_seconds":..}
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common


def _worker(rank: int, port: int, nbytes: int, reps: int, gap_s: float, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    times = []
    for i in range(reps + 3):
        time.sleep(gap_s)         # the GPUs and the link idle, as between a pipeline's batches
        dist.barrier()            # the ranks lined up: an all-reduce over the link
        torch.cuda.synchronize()  # benchmark: time each transfer alone
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    if rank == 1:
        q.put(statistics.median(times))
    dist.destroy_process_group()


def pinned_roundtrip(nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda:0").normal_()
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda:1")
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        host.copy_(src)
        dst.copy_(host)
        torch.cuda.synchronize("cuda:1")
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--bytes", type=int, default=839_000_000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gap-seconds", type=float, default=0.0,
                    help="idle time before each send")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, a.bytes, a.reps, a.gap_seconds, q)) for r in range(2)]
    for p in procs:
        p.start()
    nccl_s = q.get(timeout=300)
    for p in procs:
        p.join()
    pinned_s = pinned_roundtrip(a.bytes, 5)
    print(json.dumps({"bytes": a.bytes, "nccl_seconds": nccl_s, "nccl_bytes_per_s": a.bytes / nccl_s,
                      "pinned_seconds": pinned_s, "pinned_bytes_per_s": a.bytes / pinned_s}))


if __name__ == "__main__":
    main()
