"""Work for a second core: a function computed in a child process while the caller goes on, its answer (small:
counts, not records) collected when needed; in this process instead where it has one core. Standard library only.
"""
from __future__ import annotations

import multiprocessing
import os
import threading


def cores() -> int:
    """The processors this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _start_method() -> str:
    """fork where it is safe (this process runs one thread: no lock held elsewhere is copied into the child), else
    a fresh interpreter (forkserver, or spawn where the platform has no other)."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


def _child(conn, fn, args) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:   # the caller raises it, as if computed there
        conn.send((False, e))
    finally:
        conn.close()


class Background:
    """fn(*args) computed in a child process from construction on; result() waits for it. A child that dies without
    an answer (killed) has its work done here instead. Used as a context manager, leaving the block stops a child
    whose answer was never asked for."""

    def __init__(self, fn, *args):
        self._fn, self._args = fn, args
        ctx = multiprocessing.get_context(_start_method())
        self._conn, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
        self._proc.start()
        send.close()

    def result(self):
        try:
            ok, value = self._conn.recv()
        except EOFError:   # the child died before answering
            ok, value = True, self._fn(*self._args)
        finally:
            self._conn.close()
            self._proc.join()
        if not ok:
            raise value
        return value

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if not self._conn.closed:   # never asked for
            self._proc.terminate()
            self._proc.join()
            self._conn.close()


class Inline:
    """Background's interface, computed in this process when result() is asked for (one core: no second to use)."""

    def __init__(self, fn, *args):
        self._fn, self._args = fn, args

    def result(self):
        return self._fn(*self._args)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def in_background(fn, *args, cores_needed: int = 2):
    """fn(*args) in a child process (Background) where this process may use `cores_needed` processors, else here
    when asked (Inline)."""
    return (Background if cores() >= cores_needed else Inline)(fn, *args)
