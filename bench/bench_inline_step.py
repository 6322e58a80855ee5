"""What one drafter step's profiler calls cost the training thread, with nothing else in the step.

Run from the repo root: `PYTHONPATH=. python3 bench/bench_inline_step.py [--steps N]` (CUDA when present,
else CPU). Each "step" makes the calls `dflash/roles.py` makes on the drafter's training thread, in its
order: set_step, four spans (drafter.recv, drafter.unpack with its payload check, drafter.fwd_bwd with the
fault hook, drafter.optim with the loss/grad-norm check), one gauge, two counts and nine metrics, around a
floor of four small tensor ops (one per span, so CUDA spans record real events on a real queue). Cases,
alternated within each of 7 repeats: `no profiler` (the floor), `paused` (the in-run A/B's off arm:
`dflash-profile overhead`'s pause of every part), `profiled`, and two profiled cases without one part, to split
its cost: `no checks` (check_flags queues nothing: no pinned copy, no event) and, on CUDA, `cpu spans` (spans
without CUDA events) and `gpu 1 in 10` (spans time the GPU on one step in 10 at random: about what
dflash-train's default `--profile-gpu-steps-per-s 5` does in a launch-bound run of ~50 steps a second;
`profiled` times every step, the Profiler's default). The profiler's collector runs in its own thread,
so `profiled` includes the GIL it takes. It polls every 2 ms, not a run's 0.25 s: these steps are ~400 times
shorter than a launch-workload step, and a run's poll period would leave more checks in flight than the
monitor's pinned rows (the check would take its cheaper "dropped" path) and grow the event pool on the
training thread; the last line says how many checks were dropped and events created. The table gives the
training thread's CPU and wall per step, the cyclic garbage collector's time per step (any thread:
`gc.callbacks`), and each profiled case minus paused: what the training thread's own calls cost per step (in a
live run its CPU per step also grows when the same work runs slower beside the profiler's threads:
bench/RESULTS.md, eleventh #14 session). What was alive after the set-up is frozen (`gc.freeze()`), as
`dflash/rank.py` freezes the imports, so a full collection walks only what the steps made. Writes nothing
outside a temporary run dir.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time

CASES = ("no profiler", "paused", "profiled", "no checks", "cpu spans", "gpu 1 in 10")
CUDA_ONLY = ("cpu spans", "gpu 1 in 10")
METRICS = ("loss", "tau", "tau_prefix", "lr", "acc_1", "acc_2", "acc_3", "acc_4", "grad_norm")


def one_step(profiler, torch, x, step):
    """The drafter step's profiler calls (roles.run_drafter and drafter_step), over four tiny ops."""
    profiler.nonfinite_found()
    profiler.set_step(step)
    with profiler.span("drafter.recv"):
        y = x + 1
    profiler.gauge("queue_depth", 1)
    with profiler.span("drafter.unpack"):
        flags = torch.stack([y[0] != y[0], y[1] != y[1]])
        profiler.check_flags("drafter.recv", ["payload.packed", "payload.transfer"], flags, step=step)
    with profiler.span("drafter.fwd_bwd"):
        loss = profiler.corrupt("drafter.fwd_bwd", (y * 2).sum())
    with profiler.span("drafter.optim"):
        flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(y[0])])
        profiler.check_flags("drafter.fwd_bwd", ["loss", "grad_norm"], flags, step=step)
        x.mul_(1.0)
    profiler.count("tokens", 4096)
    profiler.count("steps", 1)
    for i, name in enumerate(METRICS):
        profiler.metric(name, 1e-3 if name == "lr" else y[i % 4].detach())


def _no_check(*args, **kwargs) -> None:
    """check_flags that queues nothing (the `no checks` case)."""


def enter_case(prof, case):
    """Put the profiler in `case`'s state; returns the call that undoes it."""
    import profiler
    from profiler.spans import CpuSpan
    if case == "no profiler":
        profiler.api.suspend(prof, None)   # span() and the rest are the no-op path
        return lambda: profiler.api.unsuspend(prof, None, prof.recorder)
    if case == "paused":
        prof.pauses.pause("bench_inline_step", 600, "all")
        return lambda: prof.pauses.resume("bench_inline_step")
    if case == "no checks":
        prof.nonfinite.check_flags = _no_check   # the instance attribute hides the method
        return lambda: delattr(prof.nonfinite, "check_flags")
    if case == "gpu 1 in 10":
        sampler = prof.gpu_sampler
        sampler.p = 0.1

        def every_step():
            sampler.p, sampler.timed[0] = 1.0, True
        return every_step
    if case == "cpu spans":   # spans without CUDA events: the recorder's CPU span class, this thread's cache cleared
        rec, cls = prof.recorder, prof.recorder._span_cls
        rec._span_cls = CpuSpan
        rec.local.d.clear()

        def leave():
            rec._span_cls = cls
            rec.local.d.clear()
        return leave
    return lambda: None


class GcClock:
    """Nanoseconds spent in cyclic collections (gc.callbacks, on whichever thread ran them)."""

    def __init__(self):
        self.ns, self._t0 = 0, 0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.ns += time.perf_counter_ns() - self._t0


def run_case(profiler, torch, x, steps, start, gc_clock):
    """(thread CPU us, wall us, gc us) per step over `steps` steps."""
    c0, w0, g0 = time.thread_time_ns(), time.perf_counter_ns(), gc_clock.ns
    for i in range(steps):
        one_step(profiler, torch, x, start + i)
    return ((time.thread_time_ns() - c0) / steps / 1e3, (time.perf_counter_ns() - w0) / steps / 1e3,
            (gc_clock.ns - g0) / steps / 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="steps per case and repeat (3000)")
    a = ap.parse_args()
    import torch

    import profiler
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.ones(8, device=device)
    rows = {case: [] for case in CASES if device.type == "cuda" or case not in CUDA_ONLY}
    gc_clock = GcClock()
    with tempfile.TemporaryDirectory() as tmp, profiler.Profiler(tmp, device=device, console=False, control=False,
                                                                 interval_s=60.0, poll_s=0.002) as prof:
        gc.freeze()   # as dflash/rank.py does after the imports
        step = 0
        for _ in range(7):   # alternate the cases within each repeat, so drift hits all alike
            for case in rows:
                leave = enter_case(prof, case)
                rows[case].append(run_case(profiler, torch, x, a.steps, step, gc_clock))
                step += a.steps
                leave()
                if device.type == "cuda":
                    torch.cuda.synchronize()   # deliberate: between cases, so queued work does not carry over
        dropped, created = prof.nonfinite.dropped, getattr(prof.event_pool, "created", 0)
    print(f"{device}, torch {torch.__version__}, Python {sys.version.split()[0]}; {a.steps} steps x 7 repeats, median")
    print(f"{'case':<22} {'cpu us/step':>12} {'wall us/step':>13} {'gc us/step':>11}")
    med = {case: [statistics.median(v[k] for v in vals) for k in (0, 1, 2)] for case, vals in rows.items()}
    for case, (cpu, wall, gc_us) in med.items():
        print(f"{case:<22} {cpu:>12.2f} {wall:>13.2f} {gc_us:>11.2f}")
    for case in rows:
        if case not in ("no profiler", "paused"):
            diff = [med[case][k] - med["paused"][k] for k in (0, 1, 2)]
            print(f"{case + '-paused':<22} {diff[0]:>+12.2f} {diff[1]:>+13.2f} {diff[2]:>+11.2f}")
    print(f"non-finite checks dropped (too many not read back): {dropped}; CUDA events created: {created}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
