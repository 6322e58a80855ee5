"""Where does an NCCL send lose bandwidth inside the pipeline? The same bytes sent from a transfer
thread on its own stream, as `dflash.transfer` does, while each GPU is (or is not) kept busy by a
stream of forward-sized GEMMs, for several orders of posting the two sides. Each variant is a fresh
pair of processes (NCCL reads its environment at init).

    python3 bench/nccl_contention.py [--bytes 335544320] [--reps 20] [--variants idle,both,...]
Prints one table: send GPU ms (p50, events on the sender's stream, as `transfer.send` times it), the
same on the receiver, the posting skew (receiver's launch minus sender's, host clock), and GEMM
throughput during the run against the same GEMMs alone.

Orders: `handshake` (sender: gloo header, then isend; receiver: header, then irecv; the trainer's
order), `ack` (the receiver answers the header only after posting its irecv; the sender launches
after the answer), `early` (the sender launches before the header, as soon as the batch is packed).
Here the host is never ahead of the GPU, so under `early` the send's kernel waits for the receiver
to post (the skew column); in the trainer the host runs a batch or two ahead and the receive is
posted long before the pack completes. The GEMM load is harsher than a real forward (1.84 ms under
it against 1.16 ms in the pipeline): use it to rank variants, not for the pipeline's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# name: (load on target, load on drafter, order, high-priority NCCL stream, extra env)
VARIANTS = {
    "idle": (False, False, "handshake", False, {}),
    "target": (True, False, "handshake", False, {}),
    "drafter": (False, True, "handshake", False, {}),
    "both": (True, True, "handshake", False, {}),
    "both_ack": (True, True, "ack", False, {}),
    "both_early": (True, True, "early", False, {}),
    "both_prio": (True, True, "handshake", True, {}),
    "both_ack_prio": (True, True, "ack", True, {}),
    "idle_ce": (False, False, "handshake", False, {"NCCL_P2P_USE_CUDA_MEMCPY": "1"}),
    "both_ce": (True, True, "handshake", False, {"NCCL_P2P_USE_CUDA_MEMCPY": "1"}),
}


class GemmLoad:
    """Forward-sized bf16 GEMMs launched back to back on the default stream from a thread, the
    host kept at most a few GEMMs ahead (an event per GEMM) so stopping is prompt."""

    def __init__(self, device: torch.device):
        self.a = torch.randn(8192, 4096, dtype=torch.bfloat16, device=device)
        self.b = torch.randn(4096, 12288, dtype=torch.bfloat16, device=device)
        self.count, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(device,), daemon=True)

    def _run(self, device) -> None:
        torch.cuda.set_device(device)
        events = []
        while not self._stop.is_set():
            torch.mm(self.a, self.b)
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
            if len(events) > 4:
                events.pop(0).synchronize()   # bench pacing: keep the host at most 4 GEMMs ahead
            self.count += 1
        torch.cuda.synchronize()

    def gemms_per_s(self, seconds: float) -> float:
        c0, t0 = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - c0) / (time.perf_counter() - t0)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _worker(rank: int, port: int, name: str, nbytes: int, reps: int, period: float, q) -> None:
    load_t, load_d, order, prio, env = VARIANTS[name]
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = prio
    data = dist.new_group([0, 1], backend="nccl", pg_options=opts)
    buf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    # Warm the NCCL communicator and the GEMM before timing.
    (dist.send if rank == 0 else dist.recv)(buf, 1 - rank, group=data)
    torch.cuda.synchronize()
    alone = GemmLoad(device).start()
    gemm_alone = alone.gemms_per_s(1.0)
    alone.stop()
    loaded = load_t if rank == 0 else load_d
    load = GemmLoad(device).start() if loaded else None
    dist.barrier()
    stream = torch.cuda.Stream(device)
    torch.cuda.set_stream(stream)
    hdr, ack = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    rows = []
    gemm_c0, t_c0 = (load.count if load else 0), time.perf_counter()
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if rank == 0:
            time.sleep(period)   # one packed batch per forward
            if order == "early":
                start.record(); t_launch = time.perf_counter()
                work = dist.isend(buf, 1, group=data); work.wait(); end.record()
                dist.send(hdr, 1)
            else:
                dist.send(hdr, 1)
                if order == "ack":
                    dist.recv(ack, 1)
                start.record(); t_launch = time.perf_counter()
                work = dist.isend(buf, 1, group=data); work.wait(); end.record()
        else:
            dist.recv(hdr, 0)
            start.record(); t_launch = time.perf_counter()
            work = dist.irecv(buf, 0, group=data); work.wait(); end.record()
            if order == "ack":
                dist.send(ack, 0)
        while not work.is_completed():
            time.sleep(50e-6)
        end.synchronize()
        if i >= 2:
            rows.append((start.elapsed_time(end) / 1e3, t_launch))
    gemm_loaded = ((load.count - gemm_c0) / (time.perf_counter() - t_c0)) if load else None
    if load:
        load.stop()
    q.put((rank, {"ms": [r[0] * 1e3 for r in rows], "launch": [r[1] for r in rows],
                  "gemm_alone": gemm_alone, "gemm_loaded": gemm_loaded}))
    dist.barrier()
    dist.destroy_process_group()


def run_variant(name: str, nbytes: int, reps: int, period: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, name, nbytes, reps, period, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    s, r = got[0], got[1]
    skew = [1e6 * (b - a) for a, b in zip(s["launch"], r["launch"])]
    return {"variant": name, "send_ms_p50": statistics.median(s["ms"]), "send_ms_min": min(s["ms"]),
            "recv_ms_p50": statistics.median(r["ms"]), "skew_us_p50": statistics.median(skew),
            "gemm_target": (s["gemm_loaded"] / s["gemm_alone"]) if s["gemm_loaded"] else None,
            "gemm_drafter": (r["gemm_loaded"] / r["gemm_alone"]) if r["gemm_loaded"] else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=5 * 8192 * 4096 * 2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--period", type=float, default=0.1, help="seconds between sends")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    rows = []
    print(f"{a.bytes / 1e6:.0f} MB per send, {a.reps} sends per variant", flush=True)
    print("| variant | send ms p50 (min) | GB/s | recv ms p50 | post skew us p50 | GEMM rate target / drafter |")
    print("|---|---|---|---|---|---|", flush=True)
    for name in a.variants.split(","):
        r = run_variant(name, a.bytes, a.reps, a.period)
        rows.append(r)
        g = " / ".join("-" if v is None else f"{v:.2f}" for v in (r["gemm_target"], r["gemm_drafter"]))
        print(f"| {name} | {r['send_ms_p50']:.3f} ({r['send_ms_min']:.3f}) | {a.bytes / r['send_ms_p50'] / 1e6:.0f} "
              f"| {r['recv_ms_p50']:.3f} | {r['skew_us_p50']:.0f} | {g} |", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "nccl_contention.json"), "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
