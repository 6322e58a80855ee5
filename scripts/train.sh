#!/usr/bin/env bash
# The README's main job: set up, then run dflash-train with the given flags.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dflash-train "$@"
