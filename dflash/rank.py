"""A rank's process, as dflash.launch starts it (`python -m dflash.rank`): the trainer's imports inside
dflash.handoff.long_lived (the cyclic collector paused, then those objects frozen out of it).
"""

from __future__ import annotations

import sys

from dflash.handoff import long_lived


def main() -> int:
    with long_lived():
        from dflash import worker
    return worker.main()


if __name__ == "__main__":
    sys.exit(main())
