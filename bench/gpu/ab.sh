#!/usr/bin/env bash
# One device call (1 GPU, about 6 minutes): profiling on vs --no-profile as paired, alternating A/B
# runs of dflash-train (bench/ab_profile.py), first on a GPU-bound random target made on the machine,
# then on the launch-bound built-in tiny target. Each workload starts no pair that would end after
# its budget (AB_GPU_BUDGET_S, AB_LAUNCH_BUDGET_S; AB_WORKLOADS="gpu launch" picks which run), so the call
# stays inside ~6 minutes; each run is pinned, rank by rank, to its own physical cores. Steps per run: at
# least AB_LAUNCH_STEPS (300) / AB_GPU_STEPS (150), more when the warm-up's rate says the measured tail
# would last under AB_LAUNCH_TAIL_S (15: three 5 s profile intervals) / AB_GPU_TAIL_S (0: keep the steps)
# seconds. On the H200 a 150-step launch run measured a tail of 1.8 s, with or without an interval close
# in it: pairs spread +-11%. The GPU workload hides the host behind the device: its off runs spread 1.1%
# at 120 steps, so short runs and more pairs serve it better, and it runs first (bench/RESULTS.md).
# Left in $OUT: ab.log (progress lines, tables, machine), ab_launch.json and ab_gpu.json (rewritten
# after every run, so a timeout keeps every finished run), ab-runs.tgz (each run's throughput file,
# config, run log and output), and ab-cache.tgz.* (the compile cache and the built-in target and
# corpus): put those in ./cache/ and carry `cache`, and the next call skips compiling and building.
# Carried .whl/*.whl (if any) are installed into /tmp/site first, as in exporters.sh.
# Diagnosis (what --no-profile changes): AB_PROBE=spy samples rank 0 of every measured run with py-spy
# for 10 s, AB_PROBE_AFTER_S (28) after its launch (all threads with --idle, and the GIL holder), and
# records each of its threads' CPU in that window and its pages per NUMA node (bench/ab_probe.py: the
# summary lists them per run when more than one node is involved); any other AB_PROBE is the
# command itself. AB_GCSTAT=1 also times every garbage collection per thread (bench/gpu/gcstat), read
# before and after the window. The files are in ab-runs.tgz as RUN.probe.*. Every probe also records the
# hypervisor's steal on the rank's CPUs and how often its two busiest threads shared a physical core;
# AB_ONE_CPU_PER_CORE=1 runs on one hyperthread per core (bench/ab_profile.py --one-cpu-per-core),
# AB_NO_ASLR=1 every run without address-space randomisation (--no-aslr), AB_CPUS=LIST every run on
# those CPUs (--cpus; default auto: GPU 0's CPU affinity).
source "$(dirname "$0")/env.sh"   # environment, carried wheels and cache
CACHE=.cache/ab-compile WORK=.cache/ab-work   # kept on a warm machine (ignored by git, not carried)
SPY="py-spy record --pid {pid} --nonblocking --threads --rate 100 --duration 10 --format raw"
GCSTAT=/tmp/gcstat
case ${AB_PROBE:-} in
  spy) AB_PROBE="cp $GCSTAT/gc-{pid}.json {out}.gc0.json 2>/dev/null; $SPY --idle -o {out}.idle.txt & p=\$!;
       $SPY --gil -o {out}.gil.txt; g=\$?; wait \$p; i=\$?; cp $GCSTAT/gc-{pid}.json {out}.gc1.json 2>/dev/null;
       exit \$((g | i))" ;;   # the probe's exit: nonzero when either py-spy failed
esac
PLACE=(); if [ "${AB_ONE_CPU_PER_CORE:-0}" = 1 ]; then PLACE=(--one-cpu-per-core); fi   # no shared cores
if [ "${AB_NO_ASLR:-0}" = 1 ]; then PLACE+=(--no-aslr); fi   # every run at the same addresses
PLACE+=(--cpus "${AB_CPUS:-auto}")   # e.g. the `independent:` line of bench/gpu/vcpu_pairs.py
PROBE=(); if [ -n "${AB_PROBE:-}" ]; then PROBE=(--probe "$AB_PROBE" --probe-after-s "${AB_PROBE_AFTER_S:-28}"); fi
if [ "${AB_GCSTAT:-0}" = 1 ]; then
  mkdir -p $GCSTAT; export PYTHONPATH=$PWD/bench/gpu/gcstat:$PYTHONPATH DFLASH_GCSTAT_DIR=$GCSTAT
fi
ab() {  # $1 workload, $2 budget s, then bench/ab_profile.py arguments
  local name=$1 budget=$2 t0=$SECONDS; shift 2
  timeout -s TERM $((budget + 60)) python3 bench/ab_profile.py --workload "$name" --budget-s "$budget" \
    --workdir "$WORK" --compile-cache "$CACHE" --json "$OUT/ab_$name.json" --cooldown-s 2 --pin-ranks \
    "${PROBE[@]}" "${PLACE[@]}" "$@"
  echo "=== $name: exit $? in $((SECONDS - t0)) s"
}
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
for w in ${AB_WORKLOADS:-gpu launch}; do
  case $w in
    launch) ab launch "${AB_LAUNCH_BUDGET_S:-150}" --steps "${AB_LAUNCH_STEPS:-300}" --pairs 12 \
              --builtin-conversations 400 --tail-seconds "${AB_LAUNCH_TAIL_S:-15}" ;;
    gpu) ab gpu "${AB_GPU_BUDGET_S:-160}" --steps "${AB_GPU_STEPS:-150}" --pairs 12 \
           --tail-seconds "${AB_GPU_TAIL_S:-0}" ;;
  esac
done
} 2>&1 | tee "$OUT/ab.log"
(cd "$WORK/runs" && tar czf "$OUT/ab-runs.tgz" */*/throughput */*/config.json */*/profile */*.log */*.probe.* 2> /dev/null)
tar czf - "$CACHE" $WORK/builtin-* 2> /dev/null | split -b 15M - "$OUT/ab-cache.tgz."
ls -la "$OUT"
