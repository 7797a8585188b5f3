#!/usr/bin/env bash
# Set up (first time) and run the quickstart: `miles run` on the embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec miles run "$@"
