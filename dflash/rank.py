"""A rank's process, as dflash.launch starts it (`python -m dflash.rank`): tied to its launcher's life (a
SIGTERM when the launcher dies, so a `kill -9` of it does not leave ranks training on), then the trainer's
imports inside dflash.handoff.long_lived (the cyclic collector paused, then those objects frozen out of it).
"""

from __future__ import annotations

import os
import signal
import sys

from dflash.handoff import long_lived

PR_SET_PDEATHSIG = 1   # linux/prctl.h


def die_with_launcher() -> bool:
    """Ask the kernel for SIGTERM when the launcher (our parent) dies; False when it already has (we were
    re-parented before asking) or this is not Linux. The SIGTERM stops the rank at a step boundary, and its
    forced stop bounds the rest (dflash/worker.py)."""
    if not sys.platform.startswith("linux"):
        return True
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return os.getppid() == parent != 1


def main() -> int:
    if not die_with_launcher():
        return 2   # the launcher is gone already: nobody will open our gate
    with long_lived():
        from dflash import worker
    return worker.main()


if __name__ == "__main__":
    sys.exit(main())
