#!/usr/bin/env bash
# A device call (2 GPUs): bench/bench_pipeline.py with the arguments given (8B-shaped random target).
source "$(dirname "$0")/env.sh"   # environment and carried wheels
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
[ -d cache ] && cat cache/cache.tgz.* | tar xzf -
{ t0=$SECONDS; timeout ${PIPE_TIMEOUT:-570} python3 bench/bench_pipeline.py "$@"; echo "=== exit $? in $((SECONDS - t0)) s"; } 2>&1 | tee "$OUT/pipeline.log"
(cd /tmp/dflash-bench && tar czf "$OUT/runs.tgz" */profile */throughput */config.json 2>/dev/null)
tar czf - .cache | split -b 15M - "$OUT/cache.tgz."; ls -la "$OUT"
