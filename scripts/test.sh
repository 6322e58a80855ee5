#!/usr/bin/env bash
# The README's test command: set up what the tests need, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The exporter tests run a real Prometheus (and promtool) against a real run: Debian's package.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "scripts/test.sh: prometheus is not installed and apt-get (as root) is not available;" \
         "the real-Prometheus tests will be skipped" >&2
  fi
fi
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
