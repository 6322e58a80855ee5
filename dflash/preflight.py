"""Everything a launch can check before any rank does work (the ranks only import meanwhile, behind
their gates: dflash/launch.py). Each problem is one ConfigError line (exit 2) naming the field or
FILE:LINE. It reads and never writes, so a corrected retry starts clean. Checked, cheapest first: the
faults, devices and rank split, the metrics ports, a --prometheus-sd-dir given, the compile and built-in cache
directories, the run directory (and --resume's checkpoint), a --target-model directory, and the --data file up to
its first record.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

from dflash import pipeline
from dflash.builtin import builtin_cache_dir, check_builtin_cache
from dflash.compile_cache import check_cache_dir, foreign_component, resolve_cache_dir
from dflash.config import ConfigError, TrainConfig, path_problem
from dflash.topology import resolve_topology

# Run-directory entries that show a run already lives there.
RUN_MARKERS = ("checkpoints", "profile")


def check(cfg: TrainConfig, world: int, local_world: int, gpus: int | None = None) -> None:
    """Raise ConfigError for the first problem found; `world` ranks, `local_world` on this host, `gpus`
    the GPUs the run uses (0: a CPU run; None: ask torch, which a CPU run's launcher never imports)."""
    gpus = torch_gpus(cfg) if gpus is None else gpus
    if cfg.profile.plan_memory and gpus == 0:
        raise ConfigError(_PLAN_CPU)
    _check_faults(cfg, world, gpus)
    _check_devices(cfg, world, local_world, gpus)
    _check_metrics_ports(cfg, local_world)
    check_early(cfg)
    _check_resume_checkpoint(cfg)
    tokenizer = _check_target(cfg)
    if cfg.data.path is not None:
        _check_data(cfg, tokenizer)


_PLAN_CPU = ("--plan-memory: needs a CUDA device (the forecast reads the allocator's per-step peaks); this run "
             "has none")
_NO_RUN = "--resume: no run in {path} (no profile/ and no checkpoint); drop --resume to start one there"


def check_early(cfg: TrainConfig) -> None:
    """The checks that need neither torch nor the device count (paths, directories, caches): the launcher runs
    them before it starts a rank or imports torch, so a mistake in them is answered in a fraction of a second.
    check() runs them too."""
    if cfg.profile.plan_memory and cfg.parallel.device == "cpu":
        raise ConfigError(_PLAN_CPU)
    _check_sd_dir(cfg)
    check_cache_dir(resolve_cache_dir(cfg.model.compile_cache_dir))
    if cfg.model.target_model is None and cfg.data.builtin_cache:
        check_builtin_cache(builtin_cache_dir())
    _check_run_dir(cfg)


def _check_faults(cfg: TrainConfig, world: int, gpus: int) -> None:
    """The fault spec (DFLASH_FAULT) parses, and each fault names a span where it can fire in this run."""
    from profiler.faults import check_injection_points, parse_faults

    spec = cfg.reliability.fault or ""
    if not spec.strip():
        return
    try:
        faults = parse_faults(spec)
        check_injection_points(faults, pipeline.fault_spans(), pipeline.nan_fault_spans(),
                               pipeline.drift_fault_spans())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    never = spans_never_entered(cfg, world, gpus)
    for f in faults:
        if f.span in never:
            raise ConfigError(f"DFLASH_FAULT: {f.kind}@{f.span}: this run never enters {f.span} ({never[f.span]}), "
                              "so the fault could never fire")


def spans_never_entered(cfg: TrainConfig, world: int, gpus: int) -> dict:
    """{span: why} for the pipeline's spans this run's topology skips: each span whose `needs`
    (dflash/pipeline.py) the run lacks."""
    unmet = _unmet_needs(cfg, world, gpus)
    return {s.name: unmet[s.needs] for s in pipeline.SPANS if s.needs in unmet}


def _unmet_needs(cfg: TrainConfig, world: int, gpus: int) -> dict:
    """{need: why} for the topologies of pipeline.NEEDS this run lacks: the host-staged copies on a CPU run or
    on NCCL transfers, a second drafter, held-out prompts."""
    unmet = {}
    distinct = gpus >= world
    if gpus == 0 or cfg.parallel.transfer == "nccl" or (cfg.parallel.transfer == "auto" and distinct):
        unmet[pipeline.HOST_COPIES] = ("a CPU run has no host-device copies" if gpus == 0
                                       else "NCCL sends device to device")
    try:
        drafters = resolve_topology(cfg, world).num_drafters
    except ConfigError:
        drafters = None   # the rank split is refused just after, in its own words
    if drafters == 1:
        unmet[pipeline.SEVERAL_DRAFTERS] = "one drafter rank has nothing to all-reduce"
    if cfg.data.eval_prompts == 0:
        unmet[pipeline.EVAL_PROMPTS] = "--eval-prompts 0"
    return unmet


def torch_gpus(cfg: TrainConfig) -> int:
    """The GPUs the run uses as torch sees them: 0 for a CPU run (torch is not imported for --device cpu)."""
    if cfg.parallel.device == "cpu":
        return 0
    import torch

    use_cuda = cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto" and torch.cuda.is_available())
    return torch.cuda.device_count() if use_cuda else 0


def _check_devices(cfg: TrainConfig, world: int, local_world: int, gpus: int) -> None:
    if cfg.parallel.device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda: no CUDA device is visible")
    use_cuda = gpus > 0
    resolve_topology(cfg, world)
    if cfg.parallel.transfer == "nccl" and not use_cuda:
        raise ConfigError("--transfer nccl: needs CUDA devices; this run is on the CPU")
    if cfg.parallel.transfer == "nccl" and gpus < local_world:
        raise ConfigError(f"--transfer nccl: {local_world} ranks on this host but only {gpus} GPUs; "
                          "NCCL needs one GPU per rank")
    if cfg.model.attn_backend == "flex" and not use_cuda:
        raise ConfigError("--attn-backend flex: FlexAttention has no backward pass on the CPU; "
                          "use dense (auto picks it there)")


def _check_metrics_ports(cfg: TrainConfig, local_world: int) -> None:
    """A --metrics-port given must be free for every local rank (base + local rank); with the default
    (which falls back to a free port) the address must be bindable."""
    if cfg.telemetry.metrics_port == 0 or not cfg.profile.enabled:
        return
    base, host = cfg.telemetry.metrics_port, cfg.telemetry.metrics_host
    for local_rank in range(local_world if base is not None else 1):
        port = 0 if base is None else base + local_rank   # the default may fall back: the address must bind
        if port > 65535:
            raise ConfigError(f"--metrics-port {base}: local rank {local_rank} would serve on port {port} "
                              f"(base + local rank), past 65535; choose a base of at most {65536 - local_world}")
        try:
            socket.create_server((host, port)).close()
        except OSError as exc:
            if base is None:
                raise ConfigError(f"--metrics-host {host}: cannot serve metrics there "
                                  f"({exc.strerror or exc})") from None
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ConfigError(f"--metrics-port {base}: port {port} on {host} (base + local rank {local_rank}) "
                              f"{why}; choose another base port, or 0 for no endpoint") from None


def _check_sd_dir(cfg: TrainConfig) -> None:
    """A --prometheus-sd-dir given must be a directory or not exist yet (a file or a symlink there is a mistake
    the run would only warn about at its start); the default directory's problems stay warnings."""
    given = cfg.telemetry.prometheus_sd_dir
    if given is None or cfg.telemetry.metrics_port == 0 or not cfg.profile.enabled:
        return
    path = Path(given).expanduser()
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        what = "is a symlink" if path.is_symlink() else "is not a directory"
        raise ConfigError(f"--prometheus-sd-dir {given}: {what}; give a directory of yours (or leave it out: the "
                          "user cache's prometheus-sd)")
    foreign = foreign_component(path)   # the run makes it 0755: never through another user's link or directory
    if foreign:
        raise ConfigError(f"--prometheus-sd-dir {given}: {foreign}; give a directory reached only through yours "
                          "or root's")


def run_dir_conflict(path: Path, resume: bool) -> str | None:
    """A new run refuses a directory that already holds one (its log and checkpoints would mix)."""
    if resume:
        return None
    held = [name for name in RUN_MARKERS if (path / name).is_dir() and any((path / name).iterdir())]
    if not held:
        return None
    return (f"--run-dir {path}: already holds a run ({', '.join(held)}); pass --resume to continue it, "
            "or choose another directory")


def _check_run_dir(cfg: TrainConfig) -> None:
    if cfg.reliability.resume and cfg.run_dir is None:
        raise ConfigError("--resume: needs --run-dir naming the run to continue")
    problem = path_problem(cfg.run_dir or "runs")
    if problem:   # the system's ENAMETOOLONG, said before anything resolves or creates it
        raise ConfigError(f"--run-dir: {problem}")
    path = Path(cfg.run_dir or "runs").resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--run-dir {path}: exists and is not a directory")
    _check_writable(path)
    for name in RUN_MARKERS:
        if (path / name).is_dir():
            _check_writable(path / name)
    if cfg.run_dir is None:
        return
    conflict = run_dir_conflict(path, cfg.reliability.resume)
    if conflict:
        raise ConfigError(conflict)
    if cfg.reliability.resume and not (path / "profile").is_dir() and not _entries(path / "checkpoints"):
        raise ConfigError(_NO_RUN.format(path=path))   # said without torch: nothing there to read


def _entries(path: Path) -> bool:
    """Whether `path` is a directory with anything in it."""
    try:
        return any(path.iterdir())
    except OSError:
        return False


def _check_resume_checkpoint(cfg: TrainConfig) -> None:
    """A resumed run's latest checkpoint reads (its training state and its weights' header), or, where it ended
    before its first checkpoint, the run is there at all."""
    if not cfg.reliability.resume or cfg.run_dir is None:
        return
    from dflash import checkpoint   # torch: only a resumed run's preflight pays the import

    path = Path(cfg.run_dir).resolve()
    ckpt = checkpoint.latest_checkpoint(path / "checkpoints")
    if ckpt is None:   # no run there, or one that ended before its first checkpoint: it starts from step 0
        if not (path / "profile").is_dir():
            raise ConfigError(_NO_RUN.format(path=path))
        return
    checkpoint.load_training_state(ckpt, mmap=True)  # plain data only; tensors mapped, not read
    checkpoint.check_weights_header(ckpt / checkpoint.WEIGHTS_NAME)


def _check_writable(path: Path) -> None:
    """`path`, or the nearest ancestor that exists when it does not yet, accepts new entries."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if os.access(existing, os.W_OK | os.X_OK):
        return
    read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
    why = "read-only file system" if read_only else "permission denied"
    where = "" if existing == path else f" (nearest existing directory {existing})"
    raise ConfigError(f"--run-dir {path}: not writable: {why}{where}")


def _check_target(cfg: TrainConfig):
    """The tokenizer the data check needs (None when there is nothing to check)."""
    if cfg.model.target_model is None:
        if cfg.data.path is None:
            return None
        from dflash.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    if cfg.data.path is None:
        raise ConfigError("--data: required with --target-model (the built-in corpus is generated by the "
                          "built-in target)")
    target = Path(cfg.model.target_model)
    _check_target_config(target)
    _check_weights(target)
    from dflash import builtin

    tokenizer = builtin.load_tokenizer(target)
    builtin.mask_token_id(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--target-model {target}: the tokenizer has no chat template")
    return tokenizer


def _check_target_config(target: Path) -> None:
    """config.json names a model_type transformers knows as a causal LM (no trust_remote_code)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = target / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--target-model {target}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable: {e}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{path}: unknown model_type {model_type!r} (this transformers has no such architecture)")
    try:
        config = AutoConfig.from_pretrained(str(target))
    except Exception as e:  # transformers' own message, first line
        raise ConfigError(f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"{path}: model_type {model_type!r} is not a causal language model in transformers")


def _check_weights(target: Path) -> None:
    index = target / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        missing = sorted(f for f in files if not (target / f).is_file())
        if missing:
            raise ConfigError(f"{index}: names {missing[0]}, which does not exist"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    elif not (target / "model.safetensors").is_file():
        raise ConfigError(f"--target-model {target}: no model.safetensors or model.safetensors.index.json "
                          "(weights load from safetensors only)")


def _check_data(cfg: TrainConfig, tokenizer) -> None:
    from dflash.data import first_usable_record

    try:
        first_usable_record(cfg.data.path, tokenizer, cfg.data.max_length, cfg.data.on_bad_record)
    except OSError as e:
        raise ConfigError(f"--data {cfg.data.path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:  # names FILE:LINE
        raise ConfigError(str(e)) from None
