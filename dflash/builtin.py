"""Where the target and data come from: the user's paths, or the built-in tiny target and corpus.

The built-ins are built once per content into the user cache (`builtin_cache_dir()`, one entry per key of
the build's settings: dflash.tiny.builtin_settings) and copied into RUN_DIR/builtin by rank 0, so a second
run starts in seconds and every run still carries the target it was trained against. An entry is built
in a temporary directory and renamed into place: two runs building at once each make a whole one, the
first rename wins and the other's is dropped. --no-cache builds in the run directory, cache untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.compile_cache import cache_dir_problem, resolve_cache_dir
from dflash.config import ConfigError, TrainConfig
from profiler.control import pid_alive


@dataclass
class RunPaths:
    target_dir: Path
    """HF directory of the frozen target."""
    data: Path
    """Training conversations (JSONL)."""
    eval_data: Path | None
    """Held-out conversations for evaluation; None: hold out the last records of `data`."""


def prepare(cfg: TrainConfig, run_dir: Path, rank: int, ctrl_group) -> RunPaths:
    """Rank 0 builds the built-ins (idempotent, so --resume reuses them); every rank then agrees. The
    preflight (dflash.preflight, run before any rank under either launcher) has checked the paths."""
    import torch.distributed as dist

    paths: list = [None]
    if rank == 0:
        paths[0] = _prepare_local(cfg, run_dir)
    dist.broadcast_object_list(paths, src=0, group=ctrl_group)
    return paths[0]


def _prepare_local(cfg: TrainConfig, run_dir: Path) -> RunPaths:
    if cfg.model.target_model is not None:
        return RunPaths(Path(cfg.model.target_model), Path(cfg.data.path), None)
    from dflash.tiny import builtin_settings, ensure_builtin

    settings = builtin_settings(cfg.optim.seed, cfg.data.builtin_conversations, max(cfg.data.eval_prompts, 16))
    dest = run_dir / "builtin"
    if cfg.data.builtin_cache:
        built = copy_from_cache(builtin_cache_dir(), dest, settings)
    else:   # a matching build already there (a --resume) is reused
        built = ensure_builtin(dest, seed=settings["seed"], num_train=settings["num_train"],
                               num_eval=settings["num_eval"])
    data = Path(cfg.data.path) if cfg.data.path is not None else built.train_path
    return RunPaths(built.target_dir, data, built.eval_path if cfg.data.path is None else None)


# ------------------------------------------------------------------------------------ the user cache
CACHE_WHAT = "the built-in target and corpus"
"""What the cache holds, in its safety checks' words (dflash.compile_cache.cache_dir_problem)."""


def builtin_cache_dir(env=None) -> Path:
    """$XDG_CACHE_HOME/dflash/builtin, else ~/.cache/dflash/builtin."""
    return resolve_cache_dir(None, env, name="builtin")


def check_builtin_cache(root: Path) -> None:
    """ConfigError (one line, exit 2) when `root` is not a directory only this user could have filled."""
    problem = cache_dir_problem(root, CACHE_WHAT)
    if problem:
        raise ConfigError(f"built-in cache {root}: {problem}; or pass --no-cache to build the built-ins in the "
                          "run directory")


def cache_key(settings: dict) -> str:
    """The cache entry's name: a digest of everything the build depends on."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def cached_build(root: Path, settings: dict, before_publish: Callable[[], None] = lambda: None) -> Path:
    """The cache entry for `settings` under `root`, built first when missing or incomplete: in a temporary
    directory of this process, then renamed into place (`before_publish` runs just before: tests hold
    two builders there). Another process's entry that won the rename is used and ours dropped."""
    from dflash.tiny import builtin_complete, ensure_builtin

    entry = root / cache_key(settings)
    if builtin_complete(entry, settings):
        damage = manifest_problem(entry)
        if damage is None:
            return entry
        _set_aside(entry, damage)
    _make_private_dir(root)
    _remove_dead_partials(root)
    tmp = root / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    ensure_builtin(tmp, seed=settings["seed"], num_train=settings["num_train"], num_eval=settings["num_eval"])
    write_manifest(tmp)
    before_publish()
    if entry.exists() and not builtin_complete(entry, settings):   # a broken entry: set aside, then replaced
        stale = root / f".{entry.name}.stale-{os.getpid()}"
        os.rename(entry, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, entry)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(tmp, ignore_errors=True)   # another run published the same build first
    return entry


def copy_from_cache(root: Path, dest: Path, settings: dict):
    """RUN_DIR/builtin (`dest`) holding the build for `settings`: kept when it already does (a --resume),
    else copied from the cache entry (built first when missing) through a temporary name."""
    from dflash.tiny import BUILTIN_FILES, builtin_complete, builtin_data

    if builtin_complete(dest, settings) and manifest_problem(dest) is None:
        return builtin_data(dest)
    entry = cached_build(root, settings)
    check_builtin_cache(entry)   # what we are about to read: still a directory of ours alone
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(entry, tmp)
    if dest.exists():   # another build (other settings) of this run directory: replaced
        foreign = [p.name for p in dest.iterdir() if p.name not in (*BUILTIN_FILES, MANIFEST_NAME)]
        if foreign:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"{dest}: exists and is not a built-in build (holds {', '.join(sorted(foreign)[:3])})")
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return builtin_data(dest)


MANIFEST_NAME = ".dflash_manifest.json"
"""A user-cache build's files (path relative to the build -> size in bytes and sha256), written when the entry is
built and checked at every use, in the cache and in the run's copy: a truncated or changed file is found, named
and replaced before a run loads it."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(build_dir: Path) -> None:
    """MANIFEST_NAME over every file of `build_dir` (a build just made, before it is published)."""
    files = sorted(p for p in build_dir.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    manifest = {str(p.relative_to(build_dir)): {"size_bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in files}
    (build_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def manifest_problem(build_dir: Path) -> str | None:
    """What differs in `build_dir` from its manifest (the first file missing, resized or changed), or None."""
    try:
        manifest = json.loads((build_dir / MANIFEST_NAME).read_text())
        wanted = [(name, int(want["size_bytes"]), str(want["sha256"])) for name, want in manifest.items()]
    except FileNotFoundError:
        return f"no {MANIFEST_NAME} (made by an older dflash, or by hand)"
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return f"{MANIFEST_NAME} unreadable ({type(e).__name__})"
    for name, size_bytes, sha256 in wanted:
        path = build_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size_bytes:
            return f"{name} is {path.stat().st_size} bytes, {size_bytes} as built (truncated or changed)"
        if _sha256(path) != sha256:
            return f"{name} differs from its build (sha256)"
    return None


def _set_aside(entry: Path, damage: str) -> None:
    """A damaged cache entry renamed `.KEY.damaged-PID` (removed by a later build once this process is gone), said
    in one line; the caller builds it again."""
    aside = entry.with_name(f".{entry.name}.damaged-{os.getpid()}")
    try:
        os.rename(entry, aside)
    except FileNotFoundError:   # another run set it aside first
        return
    print(f"dflash-train: built-in cache entry {entry}: {damage}; set aside as {aside.name} and built again",
          file=sys.stderr, flush=True)


def _make_private_dir(root: Path) -> None:
    """`root` made 0700 when missing, then checked again (a directory swapped in since the preflight)."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"built-in cache {root}: cannot create it ({e.strerror or e})") from None
    check_builtin_cache(root)


def _remove_dead_partials(root: Path) -> None:
    """Temporary builds (`.KEY.tmp-PID`, `.KEY.stale-PID`) of processes that are gone."""
    for path in root.glob(".*-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as e:  # a directory without a usable tokenizer is bad input, not a crash
        raise ConfigError(f"--target-model: cannot load a tokenizer from {target_dir}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def mask_token_id(tokenizer) -> int:
    """The drafter's MASK id: the tokenizer's mask token, else a reserved/pad token."""
    for tid in (tokenizer.mask_token_id, tokenizer.convert_tokens_to_ids("<|mask|>")
                if "<|mask|>" in tokenizer.get_vocab() else None, tokenizer.pad_token_id):
        if tid is not None:
            return int(tid)
    raise ConfigError("--target-model: tokenizer has neither a mask nor a pad token for the drafter's MASK")
