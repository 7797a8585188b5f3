#!/usr/bin/env bash
# Set up (first time) and run the test suite. Extra arguments go to pytest.
# Two pytest-xdist workers, each taking whole files (module fixtures built once): the suite's
# single-threaded Triton-interpreter files overlap with the rest on two cores. A later -n
# overrides (`bash scripts/test.sh -n 0 tests/x.py` runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -n 2 --dist loadfile "$@"
