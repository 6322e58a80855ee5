#!/usr/bin/env bash
# One device call (1 GPU): CUDA tests, then the exporter end-to-end test with the run on the GPU (so
# the NVML and allocator panels must answer too), then the exporter benchmark. Needs the carried
# .whl (OTel, py-spy) and .devout/{prometheus,promtool}.xz (Debian's 2.42 binaries, xz-compressed).
source "$(dirname "$0")/env.sh"   # environment and carried wheels
mkdir -p /tmp/bin; export PATH=/tmp/bin:$PATH
for b in prometheus promtool; do python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" .devout/$b.xz /tmp/bin/$b; chmod +x /tmp/bin/$b; done
step() { echo "=== $1"; shift; timeout "$@"; echo "=== exit $?"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, google.protobuf as p; print('torch', torch.__version__, 'protobuf', p.__version__)"
step "cuda tests" 200 python3 -m pytest -q -rs -m cuda tests -p no:cacheprovider
step "exporters e2e on cuda" 240 env DFLASH_E2E_DEVICE=cuda python3 -m pytest -q -rs -p no:cacheprovider tests/integration/test_exporters_e2e.py
step "bench_exporters" 90 python3 bench/bench_exporters.py
} 2>&1 | tee "$OUT/exporters.log"
