#!/usr/bin/env bash
# Idempotent setup: a project venv in .venv with torch (CPU wheel when no torch is present) and this
# project installed editable with its test extras. Safe to run on every invocation.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # Install torch before the project: a bare `torch` requirement with no torch present resolves to a
  # CUDA build of several GB. 2.13.0 lies on this workplace's disk as a CPU wheel; elsewhere fall back
  # to the official CPU index.
  "$VPY" -m pip install -q torch==2.13.0 \
    || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
stamp=.venv/.dflash-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VPY" -m pip install -q -e '.[test]'
  # Holistic Trace Analysis reads the Kineto captures in the tests; without --no-deps it pulls jupyterlab
  # (its parser needs only pandas, plotly and psutil, which the test extras hold). traceinsight is its maintained
  # distribution; HolisticTraceAnalysis stops at 0.5.0. Both install the module hta, so the old one goes first.
  if "$VPY" -m pip show -q HolisticTraceAnalysis >/dev/null 2>&1; then
    "$VPY" -m pip uninstall -q -y HolisticTraceAnalysis
  fi
  "$VPY" -m pip install -q --no-deps traceinsight==0.6.1
  touch "$stamp"
fi
