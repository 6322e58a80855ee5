"""The two roles' loops; each step function reads top to bottom like DESIGN.md's data-flow lines (each span a row
of dflash/pipeline.py, which says what its time is and where faults fire):

    target rank:  target.fetch -> target.fwd -> target.pack_hidden -> [d2h_copy] -> transfer.send
    drafter rank: drafter.recv -> [h2d_copy] -> drafter.unpack -> drafter.fwd_bwd -> drafter.allreduce -> drafter.optim
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import profiler
from dflash import checkpoint, startup, transfer
from dflash.attention import resolve_backend
from dflash.config import TrainConfig
from dflash.data import TokenBatcher
from dflash.flops import target_forward_flops
from dflash.loss import compute_loss
from dflash.model import DFlashDraftModel, draft_config_for_target
from dflash.numerics_watch import LayerWatch, UpdateWatch, layer_views
from dflash.compile_cache import compile_seconds
from dflash.optim import build_optimizer
from dflash.pack import PackedBatch, WireHeader, pack_hidden
from dflash.progress import Progress
from dflash.target import TargetCapture, default_layer_ids, load_target_head
from dflash.throughput import ThroughputMeter
from dflash.topology import Topology
from profiler import nonfinite

AHEAD_BATCHES = 3
"""Batches a target can make beyond its `max_in_flight` before its drafter takes any: the receiver's queue of
two and the one its thread holds."""
NUMERICS_SETTLE_STEPS = 3
"""Steps after a drafter's learning-rate warm-up before its numerics baselines begin (the warm-up's end moves the
update ratio and the gradient norm)."""


def warmup_steps(cfg: TrainConfig, role: str) -> int:
    """Steps (batches on a target) that are warm-up: a drafter's first compile; a target's batches up to the one
    its drafter takes when its own warm-up ends (the ones before only fill the queues ahead of the drafter)."""
    drafter = min(5, cfg.optim.max_steps // 4)
    return drafter + cfg.parallel.max_in_flight + AHEAD_BATCHES if role == "target" else drafter


class RankStop(RuntimeError):
    """A stop the rank says in one line and exits 1 for, after ending its transfers as a normal end does."""


class NonfiniteStop(RankStop):
    """--on-nonfinite stop: a NaN/Inf was found (its `nonfinite` event is written)."""


class DiskFullStop(RankStop):
    """The run log found the disk full: it keeps room for run_end only, so the rank stops."""


class NumericsStop(RankStop):
    """--on-numerics-drift stop: a statistic drifts toward overflow (its `numerics_drift` event is written)."""


def numerics_quiet_steps(cfg: TrainConfig, role: str) -> int:
    """Steps from a segment's first in which the numerics detector neither warns nor builds its baselines: a
    target's warm-up (its statistics do not move with the drafter's learning rate); a drafter's warm-up or its
    learning-rate warm-up, the longer, and NUMERICS_SETTLE_STEPS after it."""
    if role == "target":
        return warmup_steps(cfg, role)
    return max(warmup_steps(cfg, role), cfg.optim.warmup_steps) + NUMERICS_SETTLE_STEPS


def stop_if_drifting(cfg: TrainConfig) -> None:
    """At a step boundary, under --on-numerics-drift stop: the first drift warning read back so far."""
    found = profiler.numerics_drift()
    if found is not None and cfg.reliability.on_numerics_drift == "stop":
        raise NumericsStop(f"numerics drift: {found['statistic']} of {found['tensor']} in {found['span']} "
                           f"({found['rule']}) at step {found['step']}; stopped (--on-numerics-drift stop)")


def stop_if_nonfinite(cfg: TrainConfig) -> None:
    """At a step boundary, under --on-nonfinite stop: the first finding read back so far (the checks come
    back asynchronously, so a step or two after the bad one)."""
    found = profiler.nonfinite_found()
    if found is not None and cfg.reliability.on_nonfinite == "stop":
        raise NonfiniteStop(f"non-finite {found['tensor']} in {found['span']} at step {found['step']} on rank "
                            f"{found['rank']}; stopped (--on-nonfinite stop)")


def stop_if_disk_full(step: int) -> None:
    """At a step boundary, and before a checkpoint: stop once the run log found the disk full."""
    full = profiler.disk_full()
    if full is not None:
        raise DiskFullStop(disk_full_line(full, f"before step {step}"))


def disk_full_line(full: OSError, when: str) -> str:
    return f"{full.strerror.lower()}: {full.filename} could not be written; stopped {when}"


def stop_if_needed(cfg: TrainConfig, step: int) -> None:
    """The step boundary's checks: a non-finite value under --on-nonfinite stop, a drift under --on-numerics-drift
    stop, a full disk."""
    stop_if_nonfinite(cfg)
    stop_if_drifting(cfg)
    stop_if_disk_full(step)


@dataclass
class WorkerContext:
    """Everything a role needs, built once by the worker."""
    cfg: TrainConfig
    topo: Topology
    rank: int
    device: torch.device
    run_dir: Path
    target_dir: Path
    samples: list
    """Training samples (held-out ones already removed)."""
    pad_token_id: int
    mask_token_id: int
    ctrl_group: object
    """gloo group over all ranks: headers, metadata, STOP, host-staged payloads."""
    drafter_group: object
    """Drafter ranks only (gradient all-reduce)."""
    drafter_ctrl_group: object
    """Drafter ranks only, gloo (stop agreement)."""
    stop_requested: Callable[[], bool]
    """True once SIGTERM/SIGINT arrived."""
    resume_state: dict | None = None
    """Loaded training state when resuming (step, consumed per producer, optimizer, scheduler)."""
    device_payload: bool = False
    """Payload over NCCL device-to-device (else host-staged / CPU)."""
    first_step: object = field(default_factory=startup.NoFirstStep)
    """The end of start-up (dflash.startup.FirstStep): `mark("model")` once the model is built, `begin()` as
    the first step begins, so the `startup` event counts everything before it."""

    @property
    def dtype(self) -> torch.dtype:
        """The target's dtype. The built-in tiny target stays float32 on GPUs too: its random weights
        amplify bf16 rounding, so bf16 features would differ from those its corpus was made with."""
        if self.cfg.model.target_dtype != "auto":
            return getattr(torch, self.cfg.model.target_dtype)
        real_target_on_gpu = self.device.type == "cuda" and self.cfg.model.target_model is not None
        return torch.bfloat16 if real_target_on_gpu else torch.float32

    def noise_seed(self, target_index: int, batch_index: int) -> int:
        return (self.cfg.optim.seed * 1_000_003 + target_index * 100_003 + batch_index) % (2**62)


# ----------------------------------------------------------------------------------------- target
def run_target(ctx: WorkerContext) -> None:
    cfg, rank, topo = ctx.cfg, ctx.rank, ctx.topo
    target = TargetCapture.from_pretrained(ctx.target_dir, num_layers=cfg.model.num_target_layers,
                                           device=ctx.device, dtype=ctx.dtype)
    ctx.first_step.mark("model")
    shard = topo.target_index(rank)
    consumed = (ctx.resume_state or {}).get("consumed", {}).get(rank, 0)
    batcher = TokenBatcher(ctx.samples, cfg.data.tokens_per_batch, ctx.pad_token_id, cfg.optim.seed,
                           shard=shard, num_shards=topo.num_targets)
    batches = iter(batcher)
    for _ in range(consumed):  # resume: replay the data order up to the first unconsumed batch
        next(batches)
    drafter = topo.drafter_of(rank)
    stop = transfer.StopSignal(drafter, ctx.ctrl_group)
    sender = transfer.Sender(drafter, ctx.ctrl_group, cfg.parallel.max_in_flight, ctx.device_payload, ctx.device)
    staging = transfer.Staging(ctx.device, ctx.device_payload, cfg.parallel.max_in_flight + 1)
    meter = ThroughputMeter(ctx.run_dir, rank, ctx.device, "target", warm_steps=warmup_steps(cfg, "target"),
                            start_step=consumed, compile_seconds_fn=compile_seconds)
    done, tokens_total, flops_total = consumed, 0, 0.0
    ctx.first_step.begin()
    try:
        for batch_index in range(consumed, topo.quota(rank, cfg.optim.max_steps)):
            if stop.requested() or ctx.stop_requested():
                break
            stop_if_needed(cfg, batch_index)
            profiler.set_step(batch_index)
            tokens, flops = target_step(ctx, target, batches, sender, staging, shard, batch_index)
            tokens_total, flops_total, done = tokens_total + tokens, flops_total + flops, batch_index + 1
            meter.after_step(done, tokens_total, flops_total)
    except RankStop:
        _end_transfers(sender.close, stop.wait)
        raise
    sender.close()   # END after everything queued; returns once all sends completed
    meter.finish(done, tokens_total, flops_total)
    stop.wait()      # the drafter always sends STOP when it is done with us
    if cfg.reliability.on_nonfinite == "stop":
        # Deliberate wait, once at the end: every pack's check read back, so a bad pack is said and ends
        # this rank with exit 1 even when the drafter found it first and stopped us.
        profiler.settle_nonfinite()
        stop_if_nonfinite(cfg)


def target_step(ctx: WorkerContext, target: TargetCapture, batches, sender: transfer.Sender,
                staging: transfer.Staging, shard: int, batch_index: int) -> tuple[int, float]:
    """One batch through the target and onto the wire; returns its tokens and model FLOPs."""
    cfg = ctx.cfg
    with profiler.span("target.fetch"):
        batch = next(batches)
        input_ids = batch.input_ids.to(ctx.device, non_blocking=True)
        attention_mask = batch.attention_mask.to(ctx.device, non_blocking=True)
    with profiler.span("target.fwd"):
        layers = target(input_ids, attention_mask)
    # Device-memory floor of the pack: the kept tokens' K layers read once and written once.
    packed_bytes = batch.num_tokens * len(layers) * layers[0].shape[-1] * layers[0].element_size()
    with profiler.span("target.pack_hidden", bytes=2 * packed_bytes):
        packed = pack_hidden(layers, batch, cfg.optim.hidden_noise, ctx.noise_seed(shard, batch_index),
                             cfg.parallel.split_fc_layers)
        del layers
        packed.hidden = profiler.corrupt("target.pack_hidden", packed.hidden)   # nan@target.pack_hidden
        fingerprint = transfer.fingerprint(packed.hidden)   # on the device; the drafter compares it
        profiler.check_flags("target.pack_hidden", ["packed.hidden"], fingerprint[:1] != packed.hidden.numel(),
                             policy=cfg.reliability.on_nonfinite)
        if profiler.numerics_due():
            profiler.check_numerics("target.pack_hidden", layer_views(packed.hidden, target.layer_ids, packed.split),
                              policy=cfg.reliability.on_numerics_drift)
    with profiler.span("transfer.wait_slot"):
        sender.acquire()
    payload, ready, release = staging.stage(packed.hidden)
    rows, header = packed.to_wire(batch_index, detail=profiler.in_detail())   # the drafter keeps it too
    sender.submit(transfer.Message(payload, rows, list(header), ready=ready, release=release,
                                   fingerprint=fingerprint))
    flops = target_forward_flops(target.config, batch.attention_mask.sum(1), target.layer_ids)   # a CPU mask
    profiler.count("tokens", batch.num_tokens)
    profiler.count("samples", int(batch.input_ids.shape[0]))
    profiler.memory_sizes(**target_sizes(*batch.input_ids.shape))   # a shape: no sync
    profiler.count("model_flops", flops)
    return batch.num_tokens, flops


# ---------------------------------------------------------------------------------------- drafter
@dataclass
class DrafterState:
    model: DFlashDraftModel
    optimizer: torch.optim.Optimizer
    scheduler: object
    step: int = 0
    consumed: dict = field(default_factory=dict)
    """Batches consumed per producer rank (resume replays data order from here)."""
    tokens_total: int = 0
    model_flops_total: float = 0.0
    """Model FLOPs of this segment's steps (dflash/flops.py), for the steady window's rate."""
    layers: LayerWatch | None = None
    """The drafter layers' numerics hooks (dflash/numerics_watch.py)."""
    update: UpdateWatch | None = None
    """The update-to-weight ratio's weights copy at a sampled step."""
    drift_saved: bool = False
    """--on-numerics-drift checkpoint: the checkpoint after the first drift warning is written."""


def build_drafter(ctx: WorkerContext) -> DrafterState:
    cfg = ctx.cfg
    head = load_target_head(ctx.target_dir, ctx.device, ctx.dtype)
    layer_ids = default_layer_ids(head.config.num_hidden_layers, cfg.model.num_target_layers)
    torch.manual_seed(cfg.optim.seed)  # identical initialisation on every drafter rank
    num_layers = cfg.model.num_draft_layers or (2 if cfg.model.target_model is None else 5)
    dcfg = draft_config_for_target(head.config, num_layers=num_layers, block_size=cfg.model.block_size,
                                   layer_ids=layer_ids, mask_token_id=ctx.mask_token_id,
                                   attn_backend=cfg.model.attn_backend)
    model = DFlashDraftModel(dcfg, head.embed_tokens, head.lm_head, cfg.model.fused_elementwise).to(ctx.device)
    opt, sched = build_optimizer(model.parameters(), cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_steps,
                                 cfg.optim.max_steps, cfg.optim.min_lr_ratio)
    state = DrafterState(model, opt, sched, layers=LayerWatch(model.layers), update=UpdateWatch(model.parameters()))
    if ctx.resume_state is not None:
        model.load_state_dict(ctx.resume_state["model"], strict=False)
        opt.load_state_dict(ctx.resume_state["optimizer"])
        sched.load_state_dict(ctx.resume_state["scheduler"])
        state.step = ctx.resume_state["step"]
        state.consumed = dict(ctx.resume_state["consumed"])
    ctx.first_step.mark("model")
    return state


def run_drafter(ctx: WorkerContext, state: DrafterState, progress: Progress) -> None:
    cfg, topo = ctx.cfg, ctx.topo
    producers = topo.producers_of(ctx.rank)
    rx = transfer.Receiver(producers, ctx.ctrl_group, ctx.device, ctx.device_payload)
    if ctx.rank == 0:   # what a writer that died mid-save left behind, cleaned (and recorded)
        handled = checkpoint.remove_stale_partials(ctx.run_dir / "checkpoints")
        if handled:
            profiler.event("stale_checkpoint_partials", names=handled)
    meter = ThroughputMeter(ctx.run_dir, ctx.rank, ctx.device, "drafter", warm_steps=warmup_steps(cfg, "drafter"),
                            start_step=state.step, compile_seconds_fn=compile_seconds)
    try:
        stopped_by = _drafter_loop(ctx, state, rx, meter, progress)
    except RankStop:
        _end_transfers(lambda: transfer.send_stop(producers, ctx.ctrl_group), rx.drain)
        raise
    meter.finish(state.step, state.tokens_total, state.model_flops_total)
    transfer.send_stop(producers, ctx.ctrl_group)
    dropped = rx.drain()
    if stopped_by is not None:
        profiler.event("stop", reason=stopped_by, step=state.step, dropped_batches=dropped)
    save_checkpoint(ctx, state)


def _drafter_loop(ctx: WorkerContext, state: DrafterState, rx: transfer.Receiver, meter: ThroughputMeter,
                  progress: Progress) -> str | None:
    """Steps until max_steps, the stream's end or a signal (returned: why it stopped early, or None)."""
    cfg = ctx.cfg
    ctx.first_step.begin()
    while state.step < cfg.optim.max_steps:
        stop_if_needed(cfg, state.step)
        profiler.set_step(state.step)
        with profiler.span("drafter.recv"):
            msg = rx.get()
        if msg is not None and WireHeader(*msg.ints).detail:
            profiler.keep_step()   # the target's detail window holds this batch: so does ours
        profiler.gauge("queue_depth", rx.qsize())
        if _agree_to_stop(ctx, msg is None or ctx.stop_requested()):
            return "stream ended" if msg is None else "signal"
        loss, tau, lr = drafter_step(ctx, state, msg)
        progress.observe(loss, tau, lr)
        progress.update(state.step, state.tokens_total)
        meter.after_step(state.step, state.tokens_total, state.model_flops_total)
        every = cfg.reliability.checkpoint_every
        drift_save = (cfg.reliability.on_numerics_drift == "checkpoint" and not state.drift_saved
                      and profiler.numerics_drift() is not None)
        state.drift_saved = state.drift_saved or drift_save
        if (every and state.step % every == 0 or drift_save) and state.step < cfg.optim.max_steps:
            t0_s = time.perf_counter()
            save_checkpoint(ctx, state)
            meter.phase("ckpt.save", time.perf_counter() - t0_s)
    return None


def _end_transfers(*steps: Callable[[], object]) -> None:
    """After a RankStop (a non-finite value, a full disk), end the transfer protocol as a normal end does (a
    target: END, then the drafter's STOP; a drafter: STOP, then its targets' ENDs drained), so no transfer thread
    is still inside a gloo call when the process exits: CPython (before 3.14) ends such a daemon thread at
    interpreter teardown with pthread_exit, whose unwind through torch's C++ frames aborts the process
    (`terminate called without an active exception`, SIGABRT). A peer already gone has ended our threads with
    its error."""
    with contextlib.suppress(RuntimeError):
        for step in steps:
            step()


def target_sizes(rows: int, longest: int) -> dict:
    """The target step's sizes for the memory forecast (dflash/pipeline.py MEMORY_SIZES): its padded batch, rows x
    longest tokens, and the score cells an attention keeping its scores holds, rows x longest^2."""
    return {"target_tokens": rows * longest, "target_attention_cells": rows * longest * longest}


def drafter_sizes(n_tokens: int, block_rows: int, backend: str) -> dict:
    """The drafter step's sizes (MEMORY_SIZES): its context tokens and draft blocks' rows, and under dense attention
    the [block rows, context + block rows] cells of its mask and each head's scores."""
    sizes = {"drafter_tokens": n_tokens, "block_rows": block_rows}
    if backend == "dense":
        sizes["drafter_score_cells"] = block_rows * (n_tokens + block_rows)
    return sizes


def drafter_step(ctx: WorkerContext, state: DrafterState, msg: transfer.Message) -> tuple:
    cfg, model = ctx.cfg, state.model
    with profiler.span("drafter.unpack"):
        hidden = transfer.wait_ready(msg)   # the receiver already ran h2d_copy on the host path
        packed, header = PackedBatch.from_wire(hidden, msg.meta, msg.ints, ctx.device)
        _check_payload(ctx, msg, hidden, state.step, header.batch_index)
        policy = cfg.reliability.on_numerics_drift
        if profiler.numerics_due():
            profiler.check_numerics("drafter.unpack", {"hidden": packed.hidden}, policy=policy)
    generator = torch.Generator().manual_seed(cfg.optim.seed * 7919 + state.step * 131 + ctx.rank)
    with profiler.span("drafter.fwd_bwd"):
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.type == "cuda"
                    else contextlib.nullcontext())
        with autocast:
            context = packed.context(cfg.optim.hidden_noise)
            out = compute_loss(model, packed, context, cfg.optim.num_anchors, cfg.optim.gamma, generator,
                               cfg.model.fused_ce)
        loss = profiler.corrupt("drafter.fwd_bwd", out.loss, kinds=("nan",))   # drift: the first layer's hook
        if profiler.numerics_due():
            profiler.check_numerics("drafter.fwd_bwd", {**state.layers.take(), "loss": loss.detach()}, policy=policy)
        loss.backward()
    if ctx.topo.num_drafters > 1:
        with profiler.span("drafter.allreduce"):
            _allreduce_grads(model, ctx.drafter_group, ctx.topo.num_drafters)
    with profiler.span("drafter.optim"):
        grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                     if cfg.optim.grad_clip > 0 else None)
        if grad_norm is not None and profiler.numerics_due():
            profiler.check_numerics("drafter.optim", {"grad_norm": grad_norm.detach()}, policy=policy)
        state.update.before(state.step)
        _optimizer_step(ctx, state, loss, grad_norm)
        state.update.after(policy)
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
    n_tokens = int(msg.meta.shape[1])
    state.step += 1
    state.tokens_total += n_tokens
    state.model_flops_total += out.model_flops
    state.consumed[msg.src] = state.consumed.get(msg.src, 0) + 1
    profiler.count("tokens", n_tokens)
    profiler.count("steps", 1)
    profiler.memory_sizes(**drafter_sizes(n_tokens, out.num_anchors * model.block_size,
                                          resolve_backend(model.config.attn_backend, ctx.device)))
    profiler.count("model_flops", out.model_flops)
    # The loss as trained on (nan@drafter.fwd_bwd included); lr: the next step's, as the interval's metric says.
    lr = state.scheduler.get_last_lr()[0]
    metrics = {"loss": loss, "tau": out.tau, "tau_prefix": out.tau_prefix, "lr": lr,
               **{f"acc_{k + 1}": out.acc[k] for k in range(min(4, out.acc.numel()))}, "grad_norm": grad_norm}
    for name, value in metrics.items():
        if value is not None:
            profiler.metric(name, value.detach() if isinstance(value, torch.Tensor) else value)
    return loss.detach(), out.tau.detach(), lr


def _check_payload(ctx: WorkerContext, msg: transfer.Message, hidden: torch.Tensor, step: int,
                   batch_index: int) -> None:
    """Compare the received payload's fingerprint with the target's, on the device: `payload.packed`
    (the pack made NaN/Inf) or `payload.transfer` (the copies or the wire changed it)."""
    if msg.fingerprint is None:
        return
    flags = transfer.fingerprint_flags(msg.fingerprint, transfer.fingerprint(hidden), hidden.numel())
    profiler.check_flags("drafter.recv", ["payload.packed", "payload.transfer"], flags, step=step, src=msg.src,
                         batch=batch_index, policy=ctx.cfg.reliability.on_nonfinite)


def _optimizer_step(ctx: WorkerContext, state: DrafterState, loss: torch.Tensor, grad_norm) -> None:
    """The update; a non-finite loss or gradient norm skips it on the device (nonfinite.step_unless)
    under stop and skip-step, so the weights stay finite; under warn it is applied."""
    watched = {"loss": loss.detach()} if grad_norm is None else {"loss": loss.detach(), "grad_norm": grad_norm}
    flags = torch.stack([~torch.isfinite(t).all() for t in watched.values()])
    gate = ctx.cfg.reliability.on_nonfinite != "warn"
    profiler.check_flags("drafter.fwd_bwd", list(watched), flags, step=state.step,
                         policy=ctx.cfg.reliability.on_nonfinite,
                         action="skipped_step" if gate else "applied")
    if gate:
        nonfinite.step_unless(state.optimizer, flags.any())
    else:
        state.optimizer.step()


def _allreduce_grads(model: torch.nn.Module, group, world: int) -> None:
    """One flat all-reduce over all gradients (averaged), instead of one call per tensor."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _agree_to_stop(ctx: WorkerContext, local: bool) -> bool:
    """All drafters stop at the same step (the gradient all-reduce needs every one of them)."""
    if ctx.topo.num_drafters == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.drafter_ctrl_group)
    return bool(flag.item())  # CPU tensor over gloo: no device sync


def save_checkpoint(ctx: WorkerContext, state: DrafterState) -> None:
    """Every drafter contributes its producers' consumed counts; drafter rank 0 writes."""
    consumed = dict(state.consumed)
    if ctx.topo.num_drafters > 1:
        parts: list = [None] * ctx.topo.num_drafters
        dist.all_gather_object(parts, consumed, group=ctx.drafter_ctrl_group)
        consumed = {k: v for p in parts for k, v in p.items()}
    ckpt_dir = ctx.run_dir / "checkpoints"
    if ctx.cfg.reliability.on_nonfinite == "stop":
        profiler.settle_nonfinite()   # deliberate wait: every check so far read back before a save
        stop_if_nonfinite(ctx.cfg)
    stop_if_disk_full(state.step)
    if ctx.rank != 0 or (ckpt_dir / f"step_{state.step:07d}").exists():
        return
    t0 = time.perf_counter()
    with profiler.span("ckpt.save"):
        extra = {"step": state.step, "consumed": consumed, "optimizer": state.optimizer.state_dict(),
                 "scheduler": state.scheduler.state_dict(), "config": ctx.cfg.to_dict()}
        path = checkpoint.save_run_checkpoint(ckpt_dir, state.step, state.model, extra)
    profiler.event("checkpoint", step=state.step, path=str(path),
                   seconds=round(time.perf_counter() - t0, 3))
