#!/usr/bin/env bash
# The profiler and drafter figures of bench/RESULTS.md on the code as committed, one device call (1 GPU).
# `perf.sh a` (~5 min): the CUDA tests, CUDA and CPU span costs and the drafter step (loss
# unchunked/chunked/fused x elementwise fused off/on, one process); `perf.sh b` (~4 min): the compile
# cold/warm restart and the default drafter step. Needs the carried .whl (py-spy, OTel) only for the CUDA tests.
source "$(dirname "$0")/env.sh"   # environment and carried wheels
step() { echo "=== $1 $(date +%T)"; shift; timeout "$@"; echo "=== exit $?"; }
part=${1:-a}
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
git log --oneline -1 2>/dev/null
if [ "$part" = a ]; then
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  step "cuda tests" 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider --durations=8
  step "bench_span_cuda" 120 python3 bench/bench_span_cuda.py
  step "bench_span" 90 python3 bench/bench_span.py
  step "bench_drafter" 240 python3 bench/bench_drafter.py --backends flex --loss both --fused both --repeats 10
else
  step "bench_compile" 280 python3 bench/bench_compile.py --out /tmp/bc
  step "bench_drafter" 150 python3 bench/bench_drafter.py --backends flex --loss fused --repeats 20
fi
} 2>&1 | tee "$OUT/perf_$part.log"
