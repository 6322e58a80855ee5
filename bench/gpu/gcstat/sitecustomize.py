"""Diagnostic only (bench/gpu/ab_diag.sh puts this directory first on PYTHONPATH): every Python
process times its garbage collections per thread and generation with gc.callbacks and, once a
second, rewrites $DFLASH_GCSTAT_DIR/gc-<pid>.json with the running totals
{thread: {generation: [collections, seconds, collected]}}. Without DFLASH_GCSTAT_DIR it does nothing."""
import os

if os.environ.get("DFLASH_GCSTAT_DIR"):
    import gc
    import json
    import threading
    import time

    _totals: dict = {}
    _started: dict = {}

    def _callback(phase, info):
        key = threading.get_ident()
        if phase == "start":
            _started[key] = time.perf_counter()
            return
        t0 = _started.pop(key, None)
        if t0 is None:
            return
        row = _totals.setdefault(threading.current_thread().name, {}).setdefault(str(info["generation"]), [0, 0.0, 0])
        row[0] += 1
        row[1] += time.perf_counter() - t0
        row[2] += info.get("collected", 0)

    def _writer(path):
        while True:
            time.sleep(1.0)
            try:   # a collection on another thread may add a key meanwhile: try again next second
                text = json.dumps({"time": time.time(), "gc": _totals})
            except RuntimeError:
                continue
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)

    gc.callbacks.append(_callback)
    threading.Thread(target=_writer, name="gcstat", daemon=True,
                     args=(os.path.join(os.environ["DFLASH_GCSTAT_DIR"], f"gc-{os.getpid()}.json"),)).start()
