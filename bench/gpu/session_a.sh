#!/usr/bin/env bash
# One device call: CUDA tests, profiler and drafter micro-benchmarks, and short tiny-target runs of
# dflash-train on the GPUs (both transfer paths). Logs land in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
step() { echo "=== $1"; shift; timeout "$@"; echo "=== exit $?"; }
{
step "cuda tests" 240 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider
step "bench_span" 60 python3 bench/bench_span.py
step "bench_span_cuda" 90 python3 bench/bench_span_cuda.py
step "bench_drafter" 150 python3 bench/bench_drafter.py
step "bench_target_capture" 120 python3 bench/bench_target_capture.py
step "train nccl" 150 python3 -m dflash.cli --max-steps 30 --eval-prompts 2 --run-dir /tmp/gpu_nccl --profile-interval 10
step "train host" 150 python3 -m dflash.cli --max-steps 30 --eval-prompts 0 --run-dir /tmp/gpu_host --transfer host --profile-interval 10
} 2>&1 | tee "$OUT/session_a.log"
tar czf "$OUT/runs_a.tgz" -C /tmp gpu_nccl/profile gpu_host/profile gpu_nccl/config.json 2>/dev/null
echo done
