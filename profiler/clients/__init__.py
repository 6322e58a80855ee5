"""The out-of-process clients: what `dflash-profile` runs against a live run from another process (snapshot,
capture, top). They speak to a rank over its control socket (profiler.control) and read its logs through the
schema (profiler.schema); they never import the in-process core's torch side.
"""
