"""The numerics early warning's cost (issue #49): the trainer's drafter step with its numerics statistics on vs off
(ProfilerConfig.numerics; a profiler active in both, so only the statistics differ), repeats alternating and
paired, and the host syncs each step makes (counted under torch.cuda.set_sync_debug_mode("warn")).

The step is the trainer's: the drafter input's statistics after unpack, compute_loss with each layer's output kept
by the forward hooks (dflash/numerics_watch.py), the loss's, backward, clip_grad_norm_ and the gradient norm's, the
weights copied and the update ratio's around the AdamW step (dflash/optim.py). Shapes: bench/bench_drafter.py's
Qwen3-8B drafter (5 layers, 2 x 3072 tokens, 512 anchors a document; flex attention, fused kernels) on a GPU;
`--tiny` its tiny shapes on the CPU (a smoke test: its timings mean little).

    python3 bench/bench_numerics.py [--tiny] [--steps 20] [--repeats 7]

Goal: on the GPU the step with the statistics within 1% of the step without, zero added host syncs. The
resolution is the paired spread of two "off" halves of each repeat (what the measurement cannot tell apart).
Run logs go to a temporary dir ($OUT if set).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

import bench_drafter as bd
import profiler
from profiler import nonfinite
from dflash.loss import compute_loss
from dflash.numerics_watch import UPDATE_EVERY, LayerWatch, UpdateWatch
from dflash.optim import build_optimizer


STAGES = ("hidden", "layers", "loss", "grad", "update")
"""The step's numerics stages, each on by default; `--stages` keeps some to split the cost."""


def make_step(model, packed, shape, device, update_every: int, stages=STAGES):
    """step(i): the trainer's drafter step i with its numerics stages (which sample only when the profiler says so;
    the update ratio at every `update_every`-th); `stages` off are never taken (the cost's breakdown)."""
    update = UpdateWatch(model.parameters(), update_every if "update" in stages else 10 ** 9)
    layers = LayerWatch(model.layers)
    opt, _ = build_optimizer(model.parameters(), 1e-4, 0.0, 0, 10 ** 6, 0.1)
    ctx = packed.context(0.0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                       enabled=False)

    def step(i: int):
        if profiler.numerics_due() and "hidden" in stages:
            profiler.check_numerics("drafter.unpack", {"hidden": packed.hidden})
        with autocast:
            out = compute_loss(model, packed, ctx, shape.anchors, 7.0, torch.Generator().manual_seed(0))
        kept = layers.take() if "layers" in stages else (layers.take() and {})
        if profiler.numerics_due() and (kept or "loss" in stages):
            profiler.check_numerics("drafter.fwd_bwd", {**kept, **({"loss": out.loss.detach()} if "loss" in stages
                                                                    else {})})
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if profiler.numerics_due() and "grad" in stages:
            profiler.check_numerics("drafter.optim", {"grad_norm": grad_norm.detach()})
        update.before(i)
        opt.step()
        update.after("warn")
        opt.zero_grad(set_to_none=True)
    return step


def micro(packed, shape, device, reps: int = 20) -> None:
    """Milliseconds one tensor's statistics take on the device, the one-pass kernel vs torch's reductions, for the
    drafter's input (packed hidden), a column block of it (one target layer) and a layer-output-shaped tensor
    (docs x anchors x block tokens)."""
    rows = shape.docs * shape.anchors * shape.block
    tensors = {"hidden (all layers)": packed.hidden, "hidden column block": packed.hidden[:, :shape.hidden],
               "layer output": torch.randn(rows, shape.hidden, device=device, dtype=torch.bfloat16)}
    for name, t in tensors.items():
        info = torch.finfo(t.dtype)
        ways = {"kernel": lambda: nonfinite.fused_stats(t, info.max * 2.0 ** -8, info.tiny),
                "torch": lambda: nonfinite.torch_stats(t, info)}
        row = {}
        for way, fn in ways.items():
            for _ in range(3):
                fn()   # first launches (Triton's compile) outside the timing
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()   # deliberate: the bench reads its own events
            row[way] = start.elapsed_time(end) / reps
        print(f"micro {name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} ({t.numel() * t.element_size() / 2**20:.0f} MiB): "
              f"kernel {row['kernel']:.3f} ms, torch {row['torch']:.3f} ms ({reps} reps each, CUDA events)", flush=True)


def timed(step, steps: int, device, prof_dir: str, numerics: bool) -> float:
    """Seconds for `steps` steps under a profiler with the statistics on or off."""
    config = profiler.ProfilerConfig(interval_s=60.0, control=False, numerics=numerics, measure_floors=False)
    with profiler.Profiler(prof_dir, device=device, config=config, deps=profiler.ProfilerDeps(floors={})):
        bd.sync(device)   # deliberate: bench boundaries only
        t0 = time.perf_counter()
        for i in range(steps):
            profiler.set_step(i)
            step(i)
        bd.sync(device)
        return time.perf_counter() - t0


def count_syncs(step, device, prof_dir: str, numerics: bool) -> int | None:
    """Host syncs one step makes (set_sync_debug_mode("warn") warnings), None on the CPU."""
    if device.type != "cuda":
        return None
    config = profiler.ProfilerConfig(interval_s=60.0, control=False, numerics=numerics, measure_floors=False)
    with profiler.Profiler(prof_dir, device=device, config=config, deps=profiler.ProfilerDeps(floors={})):
        profiler.set_step(0)
        step(0)   # first launches (lazy kernel loading) outside the count
        bd.sync(device)
        profiler.set_step(0)   # a step that takes every stage, the update ratio's included
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in seen if _is_sync(w)]
        for w in syncs:   # where each sync is: the line that made it
            print(f"sync at {w.filename}:{w.lineno}: {w.message}", flush=True)
        bd.sync(device)
    return len(syncs)


def _is_sync(w) -> bool:
    """A set_sync_debug_mode("warn") report of a synchronizing call; not torch's own once-a-process note that the
    mode is a prototype ("Synchronization debug mode is a prototype feature"), which the first of two counts gets
    alone and which read as one added sync on the H100."""
    text = str(w.message)
    return "synchroniz" in text.lower() and "prototype feature" not in text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    p.add_argument("--steps", type=int, default=20, help="steps per half-repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="paired repeats (default: %(default)s)")
    p.add_argument("--update-every", type=int, default=UPDATE_EVERY,
                   help="the update ratio at every N-th sampled step (default: the trainer's, %(default)s)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"the stages taken, comma-separated among {', '.join(STAGES)} (default: all)")
    p.add_argument("--torch-stats", action="store_true",
                   help="every statistic through torch's reductions, not the one-pass kernel (the cost before it)")
    p.add_argument("--micro", action="store_true",
                   help="also time one tensor's statistics, one-pass kernel vs torch's, on the step's tensors")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    stages = tuple(x for x in args.stages.split(",") if x)
    if not stages or set(stages) - set(STAGES):
        p.error(f"--stages: among {', '.join(STAGES)}, got {args.stages!r}")
    if args.torch_stats:   # the bench's own switch: the product picks the kernel wherever it reads the tensor
        nonfinite.fused_stats = lambda t, near_above, tiny: None
    if not args.tiny and not torch.cuda.is_available():
        print("bench_numerics: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.tiny else torch.device("cuda", torch.cuda.current_device())
    shape = bd.TINY if args.tiny else bd.QWEN3_8B
    model = bd.build_model("dense" if args.tiny else "flex", device, shape, not args.tiny).float() if args.tiny \
        else bd.build_model("flex", device, shape)
    packed = bd.make_batch(device, shape)
    step = make_step(model, packed, shape, device, args.update_every, stages)
    if args.micro and device.type == "cuda":
        micro(packed, shape, device)
    root = tempfile.mkdtemp(prefix="bench_numerics_", dir=os.environ.get("OUT") or None)
    timed(step, 3, device, os.path.join(root, "warm"), True)   # compile, autotune, lazy loading
    on, off_a, off_b = [], [], []
    for r in range(args.repeats):   # off, on, off: each "on" between two "off" halves (drift hits all alike)
        off_a.append(timed(step, args.steps, device, os.path.join(root, f"a{r}"), False))
        on.append(timed(step, args.steps, device, os.path.join(root, f"on{r}"), True))
        off_b.append(timed(step, args.steps, device, os.path.join(root, f"b{r}"), False))
    paired = [o / ((a + b) / 2) - 1 for o, a, b in zip(on, off_a, off_b)]
    noise = [abs(a / b - 1) for a, b in zip(off_a, off_b)]
    where = "CPU (--tiny)" if args.tiny else torch.cuda.get_device_name(device)
    print(f"{where}, torch {torch.__version__}; drafter step {'TINY' if args.tiny else 'Qwen3-8B'} shapes; "
          f"{args.steps} steps x {args.repeats} paired repeats (off, on, off); stages {','.join(stages)}; "
          f"statistics {'torch reductions' if args.torch_stats else 'one-pass kernel where it reads the tensor'}")
    print(f"step off: median {statistics.median(off_a + off_b) / args.steps * 1e3:.3f} ms; on: median "
          f"{statistics.median(on) / args.steps * 1e3:.3f} ms")
    print(f"slowdown, paired (on over the mean of its two offs): median {statistics.median(paired) * 100:+.2f}% "
          f"(runs: {' '.join(f'{x * 100:+.2f}' for x in paired)}); resolution: median |off/off - 1| "
          f"{statistics.median(noise) * 100:.2f}%; goal <= 1%: "
          f"{'yes' if statistics.median(paired) <= 0.01 else 'NO'}")
    syncs_on = count_syncs(step, device, os.path.join(root, "sync_on"), True)
    syncs_off = count_syncs(step, device, os.path.join(root, "sync_off"), False)
    if syncs_on is None:
        print("host syncs: not counted on the CPU (set_sync_debug_mode is CUDA's)")
    else:
        print(f"host syncs per step: off {syncs_off}, on {syncs_on}, added {syncs_on - syncs_off} (goal 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
