#!/usr/bin/env bash
# Every #14 figure but the on/off A/B (bench/gpu/ab.sh, its own calls) on the code as committed, in two
# device calls of ~5 min each (1 GPU): `perf.sh a` runs the CUDA tests, per-call CUDA costs, CUDA and CPU
# span costs and the drafter step (loss unchunked/chunked/fused x elementwise fused off/on, one process);
# `perf.sh b` the step's kernel profile and the compile cold/warm/resume; `perf.sh c` re-checks the CUDA
# tests and span costs alone (~3 min); `perf.sh m` the BlockMask read off the tables against
# create_block_mask, the restart and the drafter step (~4 min). Needs the carried .whl (py-spy,
# OTel) only for the CUDA tests.
source "$(dirname "$0")/env.sh"   # environment and carried wheels
step() { echo "=== $1 $(date +%T)"; shift; timeout "$@"; echo "=== exit $?"; }
part=${1:-a}
if [ "$part" = c ]; then {   # a re-check after fixes: the CUDA tests and the span costs only (~2 min)
git log --oneline -1 2>/dev/null
step "cuda tests" 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider --durations=8
step "bench_cuda_events" 60 python3 bench/bench_cuda_events.py
step "bench_span_cuda" 120 python3 bench/bench_span_cuda.py
step "bench_span" 90 python3 bench/bench_span.py
} 2>&1 | tee "$OUT/perf_c.log"; exit; fi
if [ "$part" = m ]; then {   # the mask and the restart (~4 min): tables vs create_block_mask, step 2, the step
git log --oneline -1 2>/dev/null
step "bench_block_mask" 120 python3 bench/bench_block_mask.py
step "bench_compile" 280 python3 bench/bench_compile.py --out /tmp/bc
step "bench_drafter" 150 python3 bench/bench_drafter.py --backends flex --loss fused --repeats 20
} 2>&1 | tee "$OUT/perf_m.log"; exit; fi
if [ "$part" = a ]; then {
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log --oneline -1 2>/dev/null
step "cuda tests" 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider --durations=8
step "bench_cuda_events" 60 python3 bench/bench_cuda_events.py
step "bench_span_cuda" 120 python3 bench/bench_span_cuda.py
step "bench_span" 90 python3 bench/bench_span.py
step "bench_drafter" 240 python3 bench/bench_drafter.py --backends flex --loss both --fused both --repeats 10
} 2>&1 | tee "$OUT/perf_a.log"; else {
nvidia-smi --query-gpu=name,clocks.sm --format=csv
step "profile_drafter, fused elementwise off" 150 env DFLASH_FUSED_ELEMENTWISE=0 PYTHONPATH=$PYTHONPATH:bench \
  python3 bench/gpu/profile_drafter.py
step "profile_drafter (fused elementwise on, the default)" 150 env PYTHONPATH=$PYTHONPATH:bench \
  python3 bench/gpu/profile_drafter.py
step "bench_compile" 280 python3 bench/bench_compile.py --out /tmp/bc
} 2>&1 | tee "$OUT/perf_b.log"; fi
