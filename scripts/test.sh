#!/usr/bin/env bash
# The README's test command: set up what the tests need, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The exporter and alerting tests run a real Prometheus (and promtool) and a real Alertmanager against real
# runs: Debian's packages.
# `dflash-report html`'s page is opened in a real headless Chromium (tests/report/test_html.py): Debian's chromium.
# `dflash-profile top` is driven in a real 80x24 terminal (tests/integration/test_top_e2e.py): Debian's tmux.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1 \
    || ! command -v prometheus-alertmanager >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1 \
    || ! command -v tmux >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      prometheus prometheus-alertmanager chromium tmux >/dev/null
  else
    echo "scripts/test.sh: prometheus, prometheus-alertmanager, chromium or tmux is not installed and apt-get (as" \
         "root) is not available; the real-Prometheus, Alertmanager, Chromium and tmux tests will be skipped" >&2
  fi
fi
# The linter first: a small rule set (pyproject.toml [tool.ruff.lint]) the tree keeps clean.
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q -rs --durations=15 "$@"
