"""One run per directory: the launcher (or, under torchrun, rank 0) holds an exclusive lock on RUN_DIR/.lock
for the run's life. A second run on the directory is refused in one line naming the holder's pid; the kernel
drops the lock when its holder dies, so a dead run's lock is simply taken over."""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from dflash.config import ConfigError

LOCK_NAME = ".lock"


def hold_run_dir(run_dir) -> int:
    """Create `run_dir` (0700) if needed and lock it; returns the lock's fd (keep it open: closing it, or
    exiting, releases the lock). ConfigError when another live process holds it."""
    path = Path(run_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:   # a symlink planted there (ELOOP), a directory, another user's file: never followed
        what = "is a symlink" if (path / LOCK_NAME).is_symlink() else f"cannot be opened ({exc.strerror})"
        raise ConfigError(f"--run-dir {path}: its lock file {path / LOCK_NAME} {what}; not followed, nothing "
                          "written: remove it if it is not yours, or choose another directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise ConfigError(f"--run-dir {path}: in use by another dflash-train (pid {holder}, which holds "
                          f"{path / LOCK_NAME}); wait for it to end, or choose another directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
