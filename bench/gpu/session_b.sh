#!/usr/bin/env bash
# Second device call: flex-vs-dense diagnostic on real packed batches, the CUDA tests, and the
# two-GPU pipeline benchmark with a Qwen3-8B-shaped random target. Logs land in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== exit $?"; }
{
[ -n "${SKIP_CHECKS:-}" ] || step "check_flex" 120 python3 bench/gpu/check_flex.py
[ -n "${SKIP_CHECKS:-}" ] || step "cuda tests" 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider
step "bench_pipeline" 540 python3 bench/bench_pipeline.py --steps ${STEPS:-30} --runs ${RUNS:-nccl,nccl_noprof,host}
} 2>&1 | tee "$OUT/session_b.log"
tar czf "$OUT/runs_b.tgz" -C /tmp/dflash-bench nccl/profile nccl/throughput host/profile host/throughput nccl_noprof/throughput 2>/dev/null
echo done
