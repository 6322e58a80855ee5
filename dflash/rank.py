"""A rank's process, as dflash.launch starts it (`python -m dflash.rank`): the trainer's imports with
Python's cyclic garbage collector paused, then those objects frozen out of later collections.

Importing torch and transformers creates some 350,000 long-lived objects, and the collector's full
passes over them while they are being created are wasted: six of them, about 0.8 s of a 4 s import on
the 2-core VM (bench/RESULTS.md). After the imports `gc.freeze()` moves everything alive into the
permanent generation, so a full pass during training walks only what was created since. The launcher
does the same around its preflight (`long_lived`), which imports the same modules.
"""

from __future__ import annotations

import contextlib
import gc
import sys


@contextlib.contextmanager
def long_lived():
    """For a burst of allocations that will live as long as the process (imports): the cyclic collector
    is off inside; at the end what is alive is frozen (gc.freeze), and only then is the collector on
    again (as it was before). Frozen first, because an enabled collector would otherwise run its next
    young-generation pass over everything created inside, hundreds of thousands of objects."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def main() -> int:
    with long_lived():
        from dflash import worker
    return worker.main()


if __name__ == "__main__":
    sys.exit(main())
