"""DFlash drafter trainer: data, frozen target capture, drafter model, loss, checkpoint, decoding."""

import time as _time

IMPORTED_UNIX_NS = _time.time_ns()
"""When this package was first imported in this process: a rank's process start for the start-up
timeline (dflash/startup.py), taken before the worker imports torch."""
