#!/usr/bin/env bash
# The README's test command: set up what the tests need, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The exporter and alerting tests run a real Prometheus (and promtool) and a real Alertmanager against real
# runs: Debian's packages.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1 \
    || ! command -v prometheus-alertmanager >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      prometheus prometheus-alertmanager >/dev/null
  else
    echo "scripts/test.sh: prometheus or prometheus-alertmanager is not installed and apt-get (as root) is" \
         "not available; the real-Prometheus and Alertmanager tests will be skipped" >&2
  fi
fi
# The linter first: a small rule set (pyproject.toml [tool.ruff.lint]) the tree keeps clean.
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
