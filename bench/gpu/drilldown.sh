#!/usr/bin/env bash
# One device call (1 GPU): the drill-down's CUDA tests; HTA's temporal and kernel breakdowns of a GPU capture of
# both ranks; `ncu --nvtx --nvtx-include "target.pack_hidden/"` on a short --nvtx run checked against a capture;
# the benchmarks of bench/RESULTS.md's drill-down rows (bench_capture.py, bench_span.py --mirror). Needs the
# carried .whl (HTA, plotly, narwhals, pandas, psutil where the image lacks them; HTA is traceinsight, its maintained
# distribution: `pip download --no-deps -d .whl traceinsight==0.6.1`; the older HolisticTraceAnalysis, same module
# hta, still serves where traceinsight is not carried). Logs and JSON land in $OUT.
# Parts (default all four, about 12 min on an H200; name fewer to fit one call): tests (the drill-down's CUDA
# tests), reports (the reports and HTA on the tests' capture, in /tmp/dd-tests: also after
# `pytest -m cuda --basetemp=/tmp/dd-tests tests`), ncu (needs the tests' capture), bench.
source "$(dirname "$0")/env.sh"   # environment and carried wheels
PARTS=${*:-tests reports ncu bench}
want() { [[ " $PARTS " == *" $1 "* ]]; }
step() { echo "=== $1"; shift; local t0=$SECONDS; timeout "$@"; echo "=== exit $? in $((SECONDS - t0)) s"; }
SMALL="--builtin-conversations 48 --eval-prompts 0 --tokens-per-batch 1024 --max-length 128 --metrics-port 0"
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, hta, pandas; print('torch', torch.__version__, 'pandas', pandas.__version__, 'hta', hta.__version__)"
if want tests; then
step "drill-down cuda tests" 300 python3 -m pytest -q -rs -m cuda -p no:cacheprovider --basetemp=/tmp/dd-tests \
  tests/integration/test_capture_cuda.py
fi
CAP=$(ls -d /tmp/dd-tests/gpu-capture*/run | head -1)
if want reports; then
step "dflash-report kernels (scheduled capture)" 60 python3 -m dflash.report_cli kernels "$CAP" --capture 12
step "dflash-report memory" 60 python3 -m dflash.report_cli memory "$CAP" --top 5
step "HTA breakdowns" 120 python3 - "$CAP" <<'PY'
import shutil, sys, tempfile
from pathlib import Path
import pandas as pd
from hta.trace_analysis import TraceAnalysis
one = Path(tempfile.mkdtemp())
for r in (0, 1):
    shutil.copy(Path(sys.argv[1]) / "kineto" / f"rank{r}-step12.json.gz", one / f"rank{r}.json.gz")
ta = TraceAnalysis(trace_dir=str(one))
pd.set_option("display.width", 200)
print(ta.get_temporal_breakdown(visualize=False).to_string())
kinds, per_kernel = ta.get_gpu_kernel_breakdown(visualize=False)
print(kinds.to_string()); print(per_kernel.head(12).to_string())
PY
fi
if want ncu; then
step "ncu --nvtx target.pack_hidden" 420 ncu --nvtx --nvtx-include "target.pack_hidden/" --clock-control none \
  --target-processes all --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
  python3 -m dflash.cli --run-dir /tmp/dd-ncu --device cuda --transfer host --nvtx --max-steps 4 $SMALL \
  --no-fused-elementwise --no-fused-ce --attn-backend dense --hang-timeout-s 0
step "ncu check" 60 python3 bench/gpu/ncu_nvtx_check.py "$OUT/ncu.csv" /tmp/dd-ncu "$CAP"
fi
if want bench; then
step "bench_capture (8B-shaped drafter)" 300 python3 bench/bench_capture.py --steps 24 --at 12 --capture-steps 3
step "bench_span --mirror" 120 python3 bench/bench_span.py --mirror
fi
} 2>&1 | tee -a "$OUT/drilldown.log"
cp /tmp/dd-tests/gpu-capture*/run/kineto/rank*-step12.json.gz "$OUT/" 2>/dev/null; ls -la "$OUT"
