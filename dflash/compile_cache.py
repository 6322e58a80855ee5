"""torch.compile around the trainer: a compile cache that survives restarts (inductor and Triton read
it at the first compile, so a rank sets it up first; a cached kernel is code this process runs, so the
directory must be this user's alone), and compile time as its own `drafter.compile` span, a child of
the span that triggered the compile, never its self time.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from pathlib import Path
from collections.abc import Mapping

import profiler
from dflash.config import ConfigError

SPAN = "drafter.compile"


# ------------------------------------------------------------------------------------------- cache
def resolve_cache_dir(value: str | None, env: Mapping[str, str] | None = None, name: str = "compile") -> Path:
    """A cache directory of ours: `value` when given, else $XDG_CACHE_HOME/dflash/NAME (an absolute
    XDG_CACHE_HOME only, as the XDG spec says), else ~/.cache/dflash/NAME (`compile` for the compile cache,
    `builtin` for the built-in target and corpus: dflash/builtin.py)."""
    env = os.environ if env is None else env
    if value:
        return Path(value).expanduser().absolute()
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(env.get("HOME") or Path.home()) / ".cache"
    return (base / "dflash" / name).absolute()


def _ancestor_problem(path: Path, what: str) -> str | None:
    """Why a directory above `path` (as written and as resolved) would let another user swap what is
    loaded from it: one not yours or root's, or writable by others and not sticky; else None."""
    me = os.geteuid()
    for start in {Path(os.path.abspath(path)).parent, Path(os.path.realpath(path)).parent}:
        for d in (start, *start.parents):
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                continue
            except OSError as e:
                return f"its parent {d} cannot be examined ({e.strerror or e})"
            if st.st_uid not in (0, me):
                return (f"its parent {d} is owned by uid {st.st_uid}, who could swap what is loaded from it; "
                        f"{what} must live under directories of yours or root's")
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) \
                    and not st.st_mode & stat.S_ISVTX:
                return (f"its parent {d} is writable by others and not sticky (mode {stat.S_IMODE(st.st_mode):04o}), "
                        "so what is loaded from it could be swapped")
    return None


def foreign_component(path: Path) -> str | None:
    """The first component of `path` (as written and as resolved, itself included: a link is examined, not
    followed) owned by neither this user nor root, said as why it is refused; None when there is none. What we
    chmod must be reached through directories and links only we (or root) could have placed."""
    me = os.geteuid()
    for end in dict.fromkeys((Path(os.path.abspath(path)), Path(os.path.realpath(path)))):
        for d in (*reversed(end.parents), end):
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                break   # the rest is made by us
            except OSError as e:
                return f"{d} cannot be examined ({e.strerror or e})"
            if st.st_uid not in (0, me):
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory"
                return f"{d} is {kind} of uid {st.st_uid}, neither yours nor root's: refused"
    return None


def cache_dir_problem(path: Path, what: str = "compiled kernels") -> str | None:
    """Why `path` may not hold `what` (compiled code, by default) that this process will load, or None when
    it may (or does not exist yet). Reads only; a link itself is examined, never its target."""
    problem = _ancestor_problem(path, "compiled kernels and bytecode" if what == "compiled kernels" else what)
    if problem:
        return problem
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symlink; {what} are loaded from it, so it must be a real directory of yours"
    if not stat.S_ISDIR(st.st_mode):
        return "exists and is not a directory"
    if st.st_uid != os.geteuid():
        return (f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); {what} are "
                "loaded from it, so only you may own it")
    writers = [who for bit, who in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if st.st_mode & bit]
    if writers:
        return (f"is writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o}); {what} "
                "are loaded from it, so only you may write there (chmod go-w)")
    return None


def check_cache_dir(path: Path) -> None:
    """ConfigError (one line naming the path and why) when `path` is not a safe cache directory."""
    problem = cache_dir_problem(path)
    if problem:
        raise ConfigError(f"--compile-cache-dir {path}: {problem}")


def setup_cache(path: Path, create: bool, env: dict | None = None) -> None:
    """Point inductor's and Triton's caches at `path` (in `env`, default os.environ). `create`: make it
    now (mode 0700) and check it again, so a directory swapped in since preflight is refused too."""
    env = os.environ if env is None else env
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--compile-cache-dir {path}: cannot create it ({e.strerror or e})") from None
        check_cache_dir(path)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    env["TRITON_CACHE_DIR"] = str(path / "triton")


BYTECODE_DIR = "pycache"
"""Sub-folder of the compile cache where the ranks keep Python bytecode (`bytecode_env`)."""
BYTECODE_PROBES = ("torch", "transformers", "sympy")
"""The packages whose import dominates a rank's start-up; their bytecode decides `bytecode_env`."""


def bytecode_missing(packages=BYTECODE_PROBES) -> bool:
    """Whether one of `packages` (found, not imported) has no bytecode for this interpreter beside its
    `__init__.py`: an install without it (pip --no-compile, as in some container images)."""
    import importlib.util

    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            src = Path(spec.origin)
            if not (src.parent / "__pycache__" / f"{src.stem}.{sys.implementation.cache_tag}.pyc").exists():
                return True
    return False


def bytecode_env(enabled: bool, cache_dir: str | None, env: Mapping[str, str] | None = None,
                 dont_write: bool | None = None, missing: bool | None = None) -> dict[str, str | None]:
    """Env changes giving the ranks a bytecode cache (PYTHONPYCACHEPREFIX=CACHE/pycache, made 0700; None
    drops PYTHONDONTWRITEBYTECODE) when `enabled`, bytecode is not written (`dont_write`), the heavy
    packages have none (`missing`) and no prefix is set; else {}, also for an unsafe directory."""
    env = os.environ if env is None else env
    dont_write = (sys.flags.dont_write_bytecode or bool(env.get("PYTHONDONTWRITEBYTECODE"))
                  if dont_write is None else dont_write)
    if not enabled or not dont_write or env.get("PYTHONPYCACHEPREFIX"):
        return {}
    if not (bytecode_missing() if missing is None else missing):
        return {}
    root = resolve_cache_dir(cache_dir, env)
    path = root / BYTECODE_DIR
    if cache_dir_problem(root) or cache_dir_problem(path):
        return {}
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return {}
    if cache_dir_problem(root) or cache_dir_problem(path):   # what mkdir made, or found swapped in
        return {}
    return {"PYTHONPYCACHEPREFIX": str(path), "PYTHONDONTWRITEBYTECODE": None}


# -------------------------------------------------------------------------------------------- span
class CompileSpans:
    """The callback pair behind `install_compile_spans`; each thread keeps the span it opened."""

    def __init__(self):
        self._open = threading.local()
        self.seconds = 0.0
        """Wall seconds spent compiling so far, every thread (the throughput meter leaves them out)."""

    def start(self, args=None) -> None:
        span = profiler.span(SPAN)
        span.__enter__()
        self._open.span, self._open.t0_s = span, time.perf_counter()
        trigger = getattr(getattr(args, "callback_trigger", None), "name", None)
        tags = {"trigger": trigger.lower() if trigger else None, "compile_id": getattr(args, "compile_id", None),
                "frame": _compiling_frame_name() if trigger in (None, "DYNAMO") else None}
        profiler.tag(**{k: v for k, v in tags.items() if v is not None})

    def end(self, args=None) -> None:
        span = getattr(self._open, "span", None)
        if span is not None:   # None: a compile window that another thread started
            self._open.span = None
            span.__exit__(None, None, None)
            self.seconds += time.perf_counter() - self._open.t0_s


_spans = CompileSpans()


def compile_seconds() -> float:
    """Wall seconds spent in `drafter.compile` windows so far in this process."""
    return _spans.seconds


def install_compile_spans() -> bool:
    """Register the `drafter.compile` callbacks torch calls where a compile (a dynamo frame, a lazy
    backward) starts and ends, once. False, with one line on stderr, when this torch has none."""
    try:
        from torch._dynamo import callback_handler
        register_start, register_end = callback_handler.register_start_callback, callback_handler.register_end_callback
    except (ImportError, AttributeError) as e:
        print(f"dflash-train: no drafter.compile spans: this torch has no dynamo compile callbacks ({e}); "
              "compile time is counted in the span that triggered it", file=sys.stderr)
        return False
    if _spans.start not in callback_handler.start_callbacks:
        register_start(_spans.start)
    if _spans.end not in callback_handler.end_callbacks:
        register_end(_spans.end)
    return True


def _compiling_frame_name() -> str | None:
    """The function dynamo is compiling, from its `compile_inner(code, ...)` frame up the stack, or None."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        code = frame.f_locals.get("code") if frame.f_code.co_name == "compile_inner" else None
        if code is not None and hasattr(code, "co_name"):
            return code.co_name
        frame = frame.f_back
    return None
