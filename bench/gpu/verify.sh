#!/usr/bin/env bash
# One device call (2 GPUs): the CUDA tests; the transfer race test against mutants that drop each
# record_stream (each must fail; a mutant whose edit changed nothing fails the call); the drafter
# benchmark; short tiny-target runs of dflash-train on both transfer paths. Logs land in $OUT; the exit
# status is nonzero when a mutant was not applied or survived.
source "$(dirname "$0")/env.sh"   # environment and carried wheels
# Compilation caches inside the tree: kept while the machine stays warm, and sent back in $OUT.
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
step() { echo "=== $1"; shift; local t0=$SECONDS; timeout "$@"; echo "=== exit $? in $((SECONDS - t0)) s"; }
mutant() {  # $1 name, $2 file, $3 sed expression, $4 pytest -k: the race test must FAIL on the mutant
  rm -rf /tmp/mut && mkdir /tmp/mut && cp -r dflash profiler exporters tests pyproject.toml /tmp/mut/
  sed -i "$3" "/tmp/mut/$2"
  if cmp -s "$2" "/tmp/mut/$2"; then
    echo "mutant $1: NOT APPLIED (sed '$3' changed nothing in $2: retarget it)"; return
  fi
  if (cd /tmp/mut && PYTHONPATH=/tmp/mut timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
        "tests/dflash/test_transfer_cuda.py" -k "$4" > /tmp/mut.log 2>&1); then
    echo "mutant $1: SURVIVED (the test did not notice)"
  else grep -E "^E .*corrupted|failed|passed" /tmp/mut.log; echo "mutant $1: killed"; fi
}
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
step "cuda tests" 150 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider
# wait_ready's record_stream of the payload and fingerprint on the drafter's stream, and the host
# path's record_stream of the packed tensor on the copy stream.
mutant drafter_record_stream dflash/transfer.py 's/^                t\.record_stream(stream)$/                pass/' nccl
mutant target_record_stream dflash/transfer.py 's/^        hidden\.record_stream(self\.copy_stream)$/        pass/' host
step "bench_drafter" 150 python3 bench/bench_drafter.py
step "train nccl" 120 python3 -m dflash.cli --max-steps 30 --eval-prompts 2 --run-dir /tmp/gpu_nccl --profile-interval 10
step "train host" 100 python3 -m dflash.cli --max-steps 30 --eval-prompts 0 --run-dir /tmp/gpu_host --transfer host --profile-interval 10
} 2>&1 | tee "$OUT/verify.log"
tar czf "$OUT/runs.tgz" -C /tmp gpu_nccl/profile gpu_host/profile gpu_nccl/throughput gpu_host/throughput 2>/dev/null
tar czf "$OUT/cache.tgz" .cache 2>/dev/null; ls -la "$OUT"
! grep -qE "^mutant .*: (NOT APPLIED|SURVIVED)" "$OUT/verify.log"   # the call's exit status
