# Sourced by the device scripts (ab.sh, inrun.sh, perf.sh, exporters.sh): the environment every call
# shares. NCCL and symmetric memory without NVLink multicast (the device tool's KINDS.md), unbuffered
# output, $OUT made, the carried wheels (.whl/*.whl: py-spy, OTel, ...) installed into /tmp/site and put
# first on the paths, and the carried A/B cache (cache/ab-cache.tgz.*: compile cache, built-ins) unpacked
# into .cache/ unless a warm machine already holds one. DFLASH_COSTAT_DIR=DIR puts bench/gpu/costat first on
# PYTHONPATH (its sitecustomize writes where the profiler threads spend their CPU into DIR); so does
# DFLASH_COSTAT_NO_CUDA=1 (the collector reads back without CUDA calls) and DFLASH_COSTAT_CPU_SPANS=1 (spans
# without CUDA events): diagnostics, see that file.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
if compgen -G "cache/ab-cache.tgz.*" > /dev/null && [ ! -d .cache/ab-compile ]; then
  cat cache/ab-cache.tgz.* | tar xzf -
fi
if [ -n "${DFLASH_COSTAT_DIR:-}" ]; then   # diagnostic: the profiler threads' CPU by kind (costat/sitecustomize.py)
  mkdir -p "$DFLASH_COSTAT_DIR"
fi
if [ -n "${DFLASH_COSTAT_DIR:-}${DFLASH_COSTAT_NO_CUDA:-}${DFLASH_COSTAT_CPU_SPANS:-}" ]; then   # any: same file
  export PYTHONPATH=$PWD/bench/gpu/costat:$PYTHONPATH
fi
