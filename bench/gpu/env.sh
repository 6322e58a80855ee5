# Sourced by the device scripts (perf.sh, exporters.sh, verify.sh, pipeline.sh, drilldown.sh): the environment
# every call shares. NCCL and symmetric memory without NVLink multicast (left off on shared hosts), unbuffered
# output, $OUT made, and the carried wheels (.whl/*.whl: py-spy, OTel, ...) installed into /tmp/site and put first
# on the paths.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# traceinsight and the older HolisticTraceAnalysis both install the module hta: where both are carried, only the
# maintained one (traceinsight) goes in.
whls=()
for w in .whl/*.whl; do
  [ -e "$w" ] || continue
  case "${w,,}" in
    .whl/holistictraceanalysis-*) compgen -G ".whl/traceinsight-*.whl" > /dev/null && continue ;;
  esac
  whls+=("$w")
done
if [ ${#whls[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${whls[@]}"
fi
unset whls w
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
