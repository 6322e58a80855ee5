#!/usr/bin/env bash
# One device call (1 GPU, ~7 min): every #14 figure but the on/off A/B (bench/gpu/ab.sh, its own call) on
# the code as committed: the CUDA tests, per-call CUDA costs, CUDA and CPU span costs, the drafter step
# (loss unchunked/chunked/fused x elementwise fused off/on, one process), its kernel profile, and the
# compile cold/warm/resume. Needs the carried .whl (py-spy, OTel) only for the CUDA tests.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
step() { echo "=== $1 $(date +%T)"; shift; timeout "$@"; echo "=== exit $?"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log --oneline -1 2>/dev/null
step "cuda tests" 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider --durations=8
step "bench_cuda_events" 60 python3 bench/bench_cuda_events.py
step "bench_span_cuda" 120 python3 bench/bench_span_cuda.py
step "bench_span" 90 python3 bench/bench_span.py
step "bench_drafter" 240 python3 bench/bench_drafter.py --backends flex --loss both --fused both --repeats 10
step "profile_drafter" 120 env PYTHONPATH=$PYTHONPATH:bench python3 bench/gpu/profile_drafter.py
step "bench_compile" 300 python3 bench/bench_compile.py --out /tmp/bc
} 2>&1 | tee "$OUT/perf.log"
