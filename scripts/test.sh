#!/usr/bin/env bash
# Set up (first time) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
