"""The rank's import wrapper: no collection runs inside, what it made is frozen, the collector's state
comes back as it was."""

from __future__ import annotations

import gc

from dflash.rank import long_lived


def test_long_lived_pauses_then_freezes_and_restores():
    passes, kept = [], []
    gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
    try:
        for enabled_before in (True, False):
            (gc.enable if enabled_before else gc.disable)()
            frozen0 = gc.get_freeze_count()
            passes.clear()
            with long_lived():
                made = [[i] for i in range(50_000)]          # far past the young generation's threshold
                kept.append(made)                            # alive: frozen ones that die leave the count
                assert not gc.isenabled()
            assert passes == []                              # no pass ran over them meanwhile
            assert gc.get_freeze_count() >= frozen0 + len(made)
            assert gc.isenabled() is enabled_before
    finally:
        gc.callbacks.pop()
        gc.unfreeze()
        gc.enable()
