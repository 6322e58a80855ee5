# Sourced by the device scripts (perf.sh, exporters.sh, verify.sh, pipeline.sh, drilldown.sh): the environment
# every call shares. NCCL and symmetric memory without NVLink multicast (left off on shared hosts), unbuffered
# output, $OUT made, and the carried wheels (.whl/*.whl: py-spy, OTel, ...) installed into /tmp/site and put first
# on the paths.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
