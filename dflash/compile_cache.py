"""torch.compile around the trainer: the compile cache that survives restarts, and compile time as its
own span.

The cache. Inductor keeps its FX graph cache and AOTAutograd cache under TORCHINDUCTOR_CACHE_DIR, and
Triton its compiled kernels under TRITON_CACHE_DIR; both are read when the first compile runs, so a
rank sets them (`setup_cache`) before it builds anything. A restart then loads the kernels instead of
compiling them again (dynamo still traces the Python, a few seconds). A cached kernel is code this
process loads and runs, so the directory must be this user's alone: `cache_dir_problem` refuses a
symlink, another owner, or group/world write permission (preflight, exit 2), and the rank creates a
missing one with mode 0700 and checks it again after creating it.

The span. torch runs the callbacks registered on `torch._dynamo.callback_handler` when a compile
starts and ends: a frame that dynamo traces (trigger DYNAMO) and a backward that AOTAutograd compiles
at its first call (LAZY_BACKWARD; on CUDA that runs on autograd's device thread). `install_compile_spans`
registers a pair that opens a `drafter.compile` span on the compiling thread and closes it there, tagged
with the trigger, the compile id ("frame/recompile") and the compiled function's name, so the time shows
as a child of the span that triggered it (`drafter.fwd_bwd`) and never inside its self time. torch runs
the pair once per process-wide compile window: a compile that starts while another thread's is open
gets no span of its own (dflash compiles on one thread at a time).
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path
from typing import Mapping

import profiler
from dflash.config import ConfigError

SPAN = "drafter.compile"
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
"""Where inductor (FX graph and AOTAutograd caches) and Triton (kernels) keep their compiled code."""


# ------------------------------------------------------------------------------------------- cache
def resolve_cache_dir(value: str | None, env: Mapping[str, str] | None = None) -> Path:
    """The compile cache directory: `value` when given, else $XDG_CACHE_HOME/dflash/compile (an
    absolute XDG_CACHE_HOME only, as the XDG spec says), else ~/.cache/dflash/compile."""
    env = os.environ if env is None else env
    if value:
        return Path(value).expanduser().absolute()
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(env.get("HOME") or Path.home()) / ".cache"
    return (base / "dflash" / "compile").absolute()


def cache_dir_problem(path: Path) -> str | None:
    """Why `path` may not hold compiled code that this process will load, or None when it may (or
    does not exist yet). Reads only; the link itself is examined, never its target."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink; compiled kernels are loaded from it, so it must be a real directory of yours"
    if not stat.S_ISDIR(st.st_mode):
        return "exists and is not a directory"
    if st.st_uid != os.geteuid():
        return (f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); compiled kernels are "
                "loaded from it, so only you may own it")
    writers = [who for bit, who in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if st.st_mode & bit]
    if writers:
        return (f"is writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o}); compiled kernels "
                "are loaded from it, so only you may write there (chmod go-w)")
    return None


def check_cache_dir(path: Path) -> None:
    """ConfigError (one line naming the path and why) when `path` is not a safe cache directory."""
    problem = cache_dir_problem(path)
    if problem:
        raise ConfigError(f"--compile-cache-dir {path}: {problem}")


def setup_cache(path: Path, create: bool, env: dict | None = None) -> None:
    """Point inductor's and Triton's caches at `path` (in `env`, default os.environ) before the first
    compile. `create`: make the directory now (mode 0700) and check it again, so a directory swapped
    in since preflight is refused too; without it the first compile creates it under the rank's umask."""
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
    """The environment changes that give the ranks a bytecode cache: {} unless `enabled`, Python is told
    not to write bytecode beside its sources (`dont_write`: default sys.flags.dont_write_bytecode or
    PYTHONDONTWRITEBYTECODE in `env`), the heavy packages have none there (`missing`: default
    `bytecode_missing()`), and no PYTHONPYCACHEPREFIX is set: then every start compiles their source
    again. The changes: PYTHONPYCACHEPREFIX is CACHE/pycache, created
    0700, and PYTHONDONTWRITEBYTECODE is dropped (value None). Bytecode is code the ranks load: a cache
    directory `cache_dir_problem` refuses (checked before and after creating) gives {} here, and
    preflight's one-line error later."""
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
    """The callback pair behind `install_compile_spans`; one per process. Each thread keeps the span
    it opened, so an end on another thread never closes it."""

    def __init__(self):
        self._open = threading.local()
        self.unmatched_ends = 0
        """Ends on a thread that opened no span (a window that another thread started)."""

    def start(self, args=None) -> None:
        """torch's start callback: open the span on this thread (torch 2.6+ passes CallbackArgs;
        earlier ones nothing)."""
        span = profiler.span(SPAN)
        span.__enter__()
        self._open.span = span
        trigger = getattr(getattr(args, "callback_trigger", None), "name", None)
        tags = {"trigger": trigger.lower() if trigger else None, "compile_id": getattr(args, "compile_id", None),
                "frame": _compiling_frame_name() if trigger in (None, "DYNAMO") else None}
        profiler.tag(**{k: v for k, v in tags.items() if v is not None})

    def end(self, args=None) -> None:
        """torch's end callback: close this thread's span."""
        span = getattr(self._open, "span", None)
        if span is None:
            self.unmatched_ends += 1
            return
        self._open.span = None
        span.__exit__(None, None, None)


_spans = CompileSpans()


def install_compile_spans() -> bool:
    """Register the `drafter.compile` callbacks with torch (once; again after torch._dynamo.reset(),
    which clears them). With no active profiler each span is the no-op. False, with one line on stderr,
    when this torch has no compile callbacks: compile time then stays inside the spans around it."""
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


def uninstall_compile_spans() -> None:
    """Remove the callbacks (tests; a no-op when they are not registered)."""
    from torch._dynamo import callback_handler

    for callbacks, fn in ((callback_handler.start_callbacks, _spans.start),
                          (callback_handler.end_callbacks, _spans.end)):
        while fn in callbacks:
            callbacks.remove(fn)


def _compiling_frame_name() -> str | None:
    """The name of the function dynamo is compiling, read from its `compile_inner(code, ...)` frame a
    few levels up the callback's stack; None when this torch lays its frames out differently."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        code = frame.f_locals.get("code") if frame.f_code.co_name == "compile_inner" else None
        if code is not None and hasattr(code, "co_name"):
            return code.co_name
        frame = frame.f_back
    return None
