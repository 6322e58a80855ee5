#!/usr/bin/env bash
# One device call (1 GPU): profiling on vs off inside live runs (bench/ab_inrun.py: dflash-profile overhead),
# with a known injected cost as the peer. INRUN_WORKLOADS ("launch"), INRUN_INJECT_S ("0,0.0002": one run
# each; 0.0002 s is about 1% of a launch-workload step on the H200), INRUN_PAIRS (30), INRUN_PHASE_S (2),
# INRUN_SETTLE_S (0.5). INRUN_CUDA_TESTS=1 first runs the CUDA tests (~2 min); INRUN_SPY_S=S records who
# holds the GIL on every rank for S seconds instead of the A/B (bench/ab_inrun.py --spy-s). INRUN_PARTS ("all";
# e.g. "all,inline,background": one measurement each, on the same run, pausing that part of the profiler only).
# INRUN_PROFILE_INTERVAL (5): the runs' --profile-interval (60 is dflash-train's default). INRUN_TRAIN_ARGS: more
# dflash-train arguments (e.g. "--profile-gpu-steps-per-s 0", every step GPU-timed). INRUN_TIMEOUT_S (560):
# the limit per workload: its measurements stop after the whole pairs that fit 15 s before it (ab_inrun.py
# --deadline-s), their results kept; the hard timeout behind it loses them. INRUN_AFTER_FIRST_INTERVAL=1:
# measure only after rank 0's first interval close (until then every step is GPU-timed: no step rate yet).
# Uses ab.sh's caches: carry `cache` (ab-cache.tgz.*) and `.whl`, as for ab.sh. Left in $OUT: inrun.log,
# ab_inrun.json, inrun-runs.tgz (each run's log, overhead JSON and run log).
source "$(dirname "$0")/env.sh"   # environment, carried wheels and cache
WORK=.cache/ab-work
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
git log --oneline -1 2>/dev/null
if [ "${INRUN_CUDA_TESTS:-0}" = 1 ]; then
  echo "=== cuda tests $(date +%T)"; timeout 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider --durations=8
  echo "=== exit $?"
fi
for w in ${INRUN_WORKLOADS:-launch}; do
  t0=$SECONDS
  timeout -s TERM "${INRUN_TIMEOUT_S:-560}" python3 bench/ab_inrun.py --workload "$w" --builtin-conversations 400 --pin-ranks \
    --workdir "$WORK" --compile-cache .cache/ab-compile --json "$OUT/ab_inrun_$w.json" \
    --inject-s "${INRUN_INJECT_S:-0,0.0002}" --pairs "${INRUN_PAIRS:-30}" --phase-s "${INRUN_PHASE_S:-2}" \
    --settle-s "${INRUN_SETTLE_S:-0.5}" --spy-s "${INRUN_SPY_S:-0}" --parts "${INRUN_PARTS:-all}" \
    --profile-interval "${INRUN_PROFILE_INTERVAL:-5}" --extra="${INRUN_TRAIN_ARGS:-}" \
    --deadline-s "$(( ${INRUN_TIMEOUT_S:-560} - 15 ))" \
    ${INRUN_AFTER_FIRST_INTERVAL:+--after-first-interval}
  echo "=== $w: exit $? in $((SECONDS - t0)) s"
done
} 2>&1 | tee "$OUT/inrun.log"
(cd "$WORK/inrun" && tar czf "$OUT/inrun-runs.tgz" */*.log */*.overhead*.json */*.gil.txt */*/profile */*/config.json \
  2> /dev/null)
ls -la "$OUT"
