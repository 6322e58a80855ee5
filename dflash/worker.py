"""One rank of a dflash-train run: process group, role, profiler, then the role's loop. Started by
`dflash.launch` or torchrun; both set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import dflash
import profiler
from dflash import (builtin, checkpoint, compile_cache, evaluate, loops, memory_watch, pipeline, preflight, startup,
                    telemetry)
from dflash.cli_output import quiet_on_closed_pipe, whole_lines
from dflash.final import print_final
from dflash.stopping import StopFlag, ignore_further_signals, stop_line
from dflash.config import SAVED_CONFIG, ConfigError, TrainConfig, override_history
from dflash.run_lock import hold_run_dir
from dflash.handoff import RendezvousError, read_gate, rendezvous_store
from dflash.data import load_conversations
from dflash.progress import NullProgress, Progress
from profiler.config import ProfilerDeps
from profiler.stacks import make_stack_sampler
from profiler.watchdog import SignalWatch
from dflash.topology import Topology, cpu_threads, host_cores, resolve_topology

_SAID_IN_ONE_LINE = (ConfigError, checkpoint.CheckpointWriteError, loops.RankStop)
"""Errors a rank says in one line (bad input: exit 2; a full disk, a non-finite stop: exit 1)."""


def pick_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.parallel.device == "cpu" or (cfg.parallel.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run(cfg: TrainConfig, marks: tuple = ()) -> int:
    """Entry for one rank: 0 ok, 1 failure at run time, 2 bad input. `marks`: start-up phases so far
    as (name, unix ns) (default: the imports, ending now)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    stop = StopFlag(cfg.reliability.stop_timeout_s, on_expired=lambda name, why: _exit_unstopped(rank, name, why))
    stop.install()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress line (rank 0's), not one per weight load
    timeline = startup.StartupTimeline(dflash.IMPORTED_UNIX_NS)
    for phase, t in marks or (("imports", time.time_ns()),):
        timeline.mark(phase, t)
    try:
        device = pick_device(cfg, local_rank)
        # Before anything compiles: inductor and Triton read these at the first compile. Created (and
        # checked again) only where kernels are compiled; a CPU run never compiles the drafter.
        compile_cache.setup_cache(compile_cache.resolve_cache_dir(cfg.model.compile_cache_dir),
                                  create=device.type == "cuda")
        timeline.mark("device")
        topo = resolve_topology(cfg, world)
        if device.type == "cpu":
            # Ranks share the host's cores: don't let each one spawn a thread per core.
            asleep = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
            torch.set_num_threads(cpu_threads(topo, rank, host_cores(), asleep))
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        store = rendezvous_store(rank, world, cfg.parallel.rendezvous_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, store=store)
        timeline.mark("rendezvous")
    except ConfigError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        return 2
    except RendezvousError as e:
        print(f"dflash-train: error: rank {rank}: {e}", file=sys.stderr)
        return 1
    try:
        return _run_rank(cfg, topo, rank, device, stop, timeline)
    except _SAID_IN_ONE_LINE as e:
        print(f"dflash-train: error: rank {rank}: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except Exception as e:
        lost = _peer_lost(e)
        if lost:
            # Another rank's end, which has said why; the launcher stops us at once, else we say it.
            if not stop.wait(timeout_s=3.0):
                print(f"dflash-train: rank {rank}: stopped, another rank is gone ({lost})", file=sys.stderr)
            return 1
        print(f"dflash-train: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_unstopped(rank: int, signame: str, why: str) -> None:
    """The stop's deadline passed before the profiler runs (still starting up): nothing to record into."""
    print(f"dflash-train: rank {rank}: {signame}: {why} (still starting up); exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _run_rank(cfg: TrainConfig, topo: Topology, rank: int, device: torch.device, stop: StopFlag,
              timeline: startup.StartupTimeline) -> int:
    # Group creation is collective: every rank makes the same groups in the same order.
    ctrl = dist.new_group(backend="gloo")
    drafter_group = dist.new_group(topo.drafter_ranks)
    drafter_ctrl = dist.new_group(topo.drafter_ranks, backend="gloo")
    run_dir, run_id = _agree_run_dir(cfg, rank, ctrl)
    timeline.mark("groups")
    role = topo.role(rank)
    paths = builtin.prepare(cfg, run_dir, rank, ctrl)  # rank 0 builds the built-ins, others wait
    tokenizer = builtin.load_tokenizer(paths.target_dir)
    timeline.mark("built-ins")
    resume_state = _resume_state(cfg, run_dir, rank)
    samples, heldout = [], []
    wants_eval = rank == 0 and cfg.data.eval_prompts > 0
    if role == "target" or (wants_eval and paths.eval_data is None):
        samples = _load_samples(paths.data, tokenizer, cfg, announce=rank == topo.target_ranks[0])
        if paths.eval_data is None:
            # No separate held-out file: every rank holds out the same last records.
            samples, heldout = evaluate.split_heldout(samples, cfg.data.eval_prompts)
        if not samples:
            raise ConfigError(f"{paths.data}: no training records left after holding out {cfg.data.eval_prompts}")
    if wants_eval and paths.eval_data is not None:
        heldout = _load_samples(paths.eval_data, tokenizer, cfg, announce=True)[:cfg.data.eval_prompts]
    device_payload = _device_payload(cfg, topo, device)
    timeline.mark("data")
    ctx = loops.WorkerContext(
        cfg=cfg, topo=topo, rank=rank, device=device, run_dir=run_dir, target_dir=paths.target_dir,
        samples=samples, pad_token_id=tokenizer.pad_token_id, mask_token_id=builtin.mask_token_id(tokenizer),
        ctrl_group=ctrl, drafter_group=drafter_group, drafter_ctrl_group=drafter_ctrl,
        stop_requested=stop, resume_state=resume_state, device_payload=device_payload)
    if rank == 0:
        _write_resolved_config(cfg, topo, run_dir, run_id, device, device_payload)
    threading.current_thread().name = f"{role}.main"
    tele = telemetry.start(cfg, run_dir, rank, int(os.environ.get("LOCAL_RANK", rank)), role, ctrl, run_id)
    prof = _make_profiler(cfg, topo, rank, role, device, run_dir, run_id, tele)
    step = 0
    with contextlib.closing(tele):   # file_sd withdrawn after the barrier: every rank's last records scraped
        with prof, _forensics(stop, rank), contextlib.closing(_memory_watch(cfg, rank, device, run_dir)):
            timeline.mark("profiler")
            ctx.first_step = startup.FirstStep(timeline, lambda fields: _startup_event(fields, rank))
            for kind, fields in _PENDING_EVENTS:
                profiler.event(kind, **fields)
            if role == "target":
                loops.run_target(ctx)
            else:
                state = loops.build_drafter(ctx)
                progress = Progress(cfg.optim.max_steps, start_step=state.step) if rank == 0 else NullProgress()
                loops.run_drafter(ctx, state, progress)
                progress.update(state.step, state.tokens_total, force=True)
                step = state.step
                if rank == 0 and cfg.data.eval_prompts > 0 and not stop():   # a stop skips the evaluation
                    _evaluate(ctx, state.model, heldout, tokenizer, paths.data, len(samples))
            if stop():
                profiler.event("signal", signal=stop.name)
        stop.finish()   # the run log is closed: what is left (the barrier, rank 0's summary) takes moments
        _said_if_disk_full(prof)
        dist.barrier(group=ctrl)  # every rank's run_end is written before rank 0 reads them
    if rank == 0 and cfg.profile.plan_memory and not stop():
        lines, code = memory_watch.plan_lines(run_dir)
        print("\n".join(lines), flush=True)
        return code
    if rank == 0:
        _say_the_end(run_dir, stop, step, timeline, _run_view(cfg, run_dir, run_id))
    return 0


def _memory_watch(cfg: TrainConfig, rank: int, device: torch.device, run_dir: Path):
    """Rank 0's memory forecast while the run trains (dflash/memory_watch.py), on a CUDA device with the profiler
    on; a no-op elsewhere."""
    if rank != 0 or device.type != "cuda" or not cfg.profile.enabled:
        return memory_watch.NullWatch()
    return memory_watch.MemoryForecastWatch(run_dir, cfg.profile.interval_s).start()


def _run_view(cfg: TrainConfig, run_dir: Path, run_id: str):
    """The run's view for the per-rank sinks asked for (exporters/run_view.py), as print_final's on_report (at the
    run_ends' last step, the ranks' own records' step axis); None where there are none."""
    from exporters import run_view

    sinks = [n.strip() for n in cfg.telemetry.sinks.split(",") if n.strip() in run_view.VIEW_SINKS]
    if not sinks or not cfg.profile.enabled:
        return None
    return lambda rep, step: run_view.write(run_dir, run_id, sinks, rep, step)


def _said_if_disk_full(prof) -> None:
    """The disk filled as the last records went in (the final interval, run_end): said, though the role ended."""
    full = getattr(prof, "disk_full", None)   # None too under --no-profile: no run log
    if full is not None:
        raise loops.DiskFullStop(loops.disk_full_line(full, "as the run ended"))


def _say_the_end(run_dir: Path, stop: StopFlag, step: int, timeline: startup.StartupTimeline,
                 on_report=None) -> None:
    """Rank 0's end of the run; after a stop by a signal, with the line that says how to resume it."""
    said = (stop_line(stop.name, step, checkpoint.latest_checkpoint(run_dir / "checkpoints"), run_dir)
            if stop() else None)
    print_final(run_dir, timeline.origin, timeline.origin_ns, said, on_report=on_report)


def _startup_event(fields: dict, rank: int) -> None:
    """The start-up phases, launch to the first step: a `startup` event, and rank 0's console line (not under
    --no-profile)."""
    fields = dict(fields, intra_op_threads=torch.get_num_threads(),
                  omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    profiler.event("startup", **fields)
    if rank == 0 and profiler.active() is not None:
        print(startup.format_line(fields), flush=True)


def _make_profiler(cfg: TrainConfig, topo: Topology, rank: int, role: str, device: torch.device, run_dir: Path,
                   run_id: str, tele: telemetry.Telemetry):
    """The rank's profiler, with compile time as `drafter.compile` spans (never inside drafter.fwd_bwd);
    a null context under --no-profile."""
    if not cfg.profile.enabled:
        return contextlib.nullcontext()
    compile_cache.install_compile_spans()
    config = cfg.profiler_config(detail_follows=role == "drafter",   # a drafter keeps the batches its targets keep
                                 warmup_steps=loops.warmup_steps(cfg, role), phase_spans=pipeline.phase_spans(),
                                 numerics_quiet_steps=loops.numerics_quiet_steps(cfg, role),
                                 span_table=pipeline.span_table(), memory_sizes=pipeline.memory_sizes(),
                                 memory_caps=pipeline.memory_caps())
    deps = ProfilerDeps(stack_sampler=make_stack_sampler(os.getpid(), cfg.profile.stack_samples_per_interval,
                                                         cfg.profile.interval_s))
    return profiler.Profiler(run_dir=run_dir, rank=rank, world_size=topo.world_size, role=role, device=device,
                             run_config=cfg.flat_dict(), config=config, deps=deps, exporters=tele.exporters,
                             run_id=run_id)


@contextlib.contextmanager
def _forensics(stop: StopFlag, rank: int):
    """Inside the profiler: an exception leaving the role is recorded (`oom` or `thread_crash`); a stop that
    overruns --stop-timeout-s (a step or checkpoint too long, a rank blocked on a lost peer: the deadline of
    StopFlag, and SignalWatch's rule of no progress for as long), or a second signal, ends the rank with a dump."""
    prof = profiler.active()
    if prof is None:   # --no-profile: nothing to record into
        yield
        return

    def blocked(signame: str, why: str) -> None:
        print(f"dflash-train: rank {rank}: {signame}: {why}; stopping now (latest stays the last checkpoint "
              "written)", file=sys.stderr, flush=True)
        prof.dumper.abort("signal", f"killed: {signame}", signal=signame, reason=why, forced=True)

    watch = SignalWatch(on_signal=stop.note, observed=lambda: stop.observed, on_blocked=blocked,
                        progress=lambda: prof.progress()[1], grace_s=stop.timeout_s)
    before, stop.on_expired = stop.on_expired, blocked
    watch.install()
    try:
        # Said in one line by run() (bad input, a full disk) or a lost peer's consequence: no crash record.
        with prof.dumper.guard(ignore=lambda e: _record_peer_lost(prof, e) or isinstance(e, _SAID_IN_ONE_LINE)):
            yield
    finally:
        watch.close()
        stop.on_expired = before


def _record_peer_lost(prof, exc: BaseException) -> bool:
    """True when `exc` is a lost peer's consequence; then this rank's side goes in its log, quietly: a
    `peer_lost` dump (open spans, stacks, transfer ring) to line up with the peer's. Never raises."""
    lost = _peer_lost(exc)
    if lost:
        prof.dumper.dump_final("peer_lost", reason=lost)
    return bool(lost)


# Events found before the profiler starts (data loading), written once it is active.
_PENDING_EVENTS: list[tuple[str, dict]] = []


def _load_samples(path: Path, tokenizer, cfg: TrainConfig, announce: bool) -> list:
    """`announce`: this rank reports bad records (and fails on them with --on-bad-record fail); the other
    ranks reading the same file only count them."""
    try:
        samples, bad = load_conversations(path, tokenizer, cfg.data.max_length,
                                          cfg.data.on_bad_record if announce else "skip")
    except ValueError as e:  # the loader's message names file:line
        raise ConfigError(str(e)) from None
    if bad.count:
        _PENDING_EVENTS.append(("bad_records", {"path": str(path), "count": bad.count,
                                                "examples": bad.examples[:5]}))
        if announce:
            print(f"dflash-train: skipped {bad.count} bad records in {path} (first: {bad.examples[0]})",
                  file=sys.stderr)
    return samples


def _evaluate(ctx: loops.WorkerContext, model, heldout: list, tokenizer, data: Path, records: int) -> None:
    """The end-of-run evaluation, or, where its result would be, why there is none."""
    if heldout:
        evaluate.run_eval(ctx, model, heldout, tokenizer)
        return
    why = (f"{data} has {records} usable records, too few to hold out --eval-prompts {ctx.cfg.data.eval_prompts} "
           "and train on the rest")
    print(f"dflash-train: evaluation skipped: {why}", file=sys.stderr)
    profiler.event("eval_skipped", reason=why)


def _peer_lost(exc: BaseException) -> str | None:
    """How a collective or transfer failed, when it failed because another rank's process ended."""
    found = re.search(r"Connection (closed|reset) by peer( \[[^\]]*\]:\d+)?|Broken pipe", str(exc))
    return found.group(0) if found and isinstance(exc, RuntimeError) else None


def _resume_state(cfg: TrainConfig, run_dir: Path, rank: int) -> dict | None:
    """--resume's training state; None for a fresh run, and for a run that ended before its first checkpoint
    (it starts again from step 0, a new segment of the same run directory, and rank 0 says so)."""
    if not cfg.reliability.resume:
        return None
    state = checkpoint.load_resume_state(run_dir)
    if state is None and rank == 0:
        print(f"dflash-train: --resume: {run_dir} has no checkpoint (its run ended before the first one): "
              "starting from step 0", file=sys.stderr, flush=True)
    return state


def _device_payload(cfg: TrainConfig, topo: Topology, device: torch.device) -> bool:
    """NCCL device-to-device unless told otherwise or impossible (CPU, or two ranks on one GPU)."""
    if device.type != "cuda":   # --transfer nccl on the CPU: refused by the preflight
        return False
    distinct = torch.cuda.device_count() >= topo.world_size
    if cfg.parallel.transfer == "nccl" and not distinct:
        raise ConfigError(f"--transfer nccl: {topo.world_size} ranks but only {torch.cuda.device_count()} GPUs; "
                          "NCCL needs one GPU per rank")
    return cfg.parallel.transfer == "nccl" or (cfg.parallel.transfer == "auto" and distinct)


def _agree_run_dir(cfg: TrainConfig, rank: int, ctrl) -> tuple[Path, str]:
    """Rank 0 names and checks the run directory and gives the run its id; every rank gets its answer (so all
    exit 2 alike)."""
    box = [None, None, None]
    if rank == 0:
        path = Path(cfg.run_dir or time.strftime("runs/%Y%m%d-%H%M%S")).resolve()
        box = [str(path), preflight.run_dir_conflict(path, cfg.reliability.resume), _run_id(path, cfg)]
        if box[1] is None and startup.ENV_LAUNCH_NS not in os.environ:   # torchrun: no launcher holds it
            try:
                hold_run_dir(path)   # kept for this process's life
            except ConfigError as e:
                box[1] = str(e)
    dist.broadcast_object_list(box, src=0, group=ctrl)
    if box[1] is not None:
        raise ConfigError(box[1])
    path = Path(box[0])
    path.mkdir(parents=True, exist_ok=True)
    return path, box[2]


def _run_id(run_dir: Path, cfg: TrainConfig) -> str:
    """The run's id (run_start's `run_id`, the Prometheus `run` label, OTel's dflash.run_id): unique per run, as
    `DIRNAME-STARTTIME-PID`, and kept by a --resume (RUN_DIR/config.json holds it), so two runs in directories
    of the same name never share it while the segments of one run do."""
    if cfg.reliability.resume:
        try:
            kept = json.loads((run_dir / "config.json").read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            kept = None
        if isinstance(kept, str) and kept:
            return kept
    return f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _write_resolved_config(cfg: TrainConfig, topo: Topology, run_dir: Path, run_id: str, device,
                           device_payload) -> None:
    """RUN_DIR/config.json (atomic): the settings a --resume restores (paths made absolute, so it works from any
    directory), the run's id and topology, and the history of what each --resume changed (never lost)."""
    path = run_dir / SAVED_CONFIG
    previous = None
    if cfg.reliability.resume:
        try:
            previous = json.loads(path.read_text())
        except (OSError, ValueError):   # no config.json (a run that died before writing it): no history
            previous = None
    settings = cfg.to_dict()
    for section, key in (("model", "target_model"), ("data", "path")):
        if settings[section][key] is not None:
            settings[section][key] = os.path.abspath(settings[section][key])
    now = TrainConfig.from_dict(settings).flat_dict()
    overrides = override_history(previous, now, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    resolved = dict(settings, run_dir=str(run_dir), run_id=run_id, overrides=overrides,
                    resolved={"target_ranks": topo.num_targets, "drafter_ranks": topo.num_drafters,
                              "device": str(device.type), "transfer": "nccl" if device_payload else "host",
                              "compile_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")})
    tmp = run_dir / f"{SAVED_CONFIG}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(resolved, indent=2) + "\n")
    tmp.replace(path)


def main() -> int:
    """A rank started by dflash.launch, its imports done: the config from the gate once the preflight
    passed (EOF: it did not, or the launcher is gone; exit quietly)."""
    imported_ns = time.time_ns()
    whole_lines(sys.stderr)   # the ranks' error lines share one stderr: each goes out whole
    try:
        data = read_gate()
    except ConfigError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        return 2
    if not data:
        return 2
    marks = (("imports", imported_ns), ("preflight", time.time_ns()))
    try:
        with quiet_on_closed_pipe():   # `dflash-train | head`: the rank trains on, silently
            return run(TrainConfig.from_dict(json.loads(data)).validate(), marks)
    finally:
        ignore_further_signals()   # done: a late signal must not kill the exit (dflash/stopping.py)


if __name__ == "__main__":
    sys.exit(main())
