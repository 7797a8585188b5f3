#!/usr/bin/env bash
# Set up (first time) and run the test suite. Extra arguments go to pytest.
# Two pytest-xdist workers, each taking whole files (module fixtures built once): the suite's
# single-threaded Triton-interpreter files overlap with the rest on two cores. A later -n
# overrides (`bash scripts/test.sh -n 0 tests/x.py` runs in this process). One intra-op thread
# per process unless OMP_NUM_THREADS says otherwise: two workers of two threads on two cores
# oversubscribe (clean-clone CI: 825 s against 1,076 s with torch's default threads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q -n 2 --dist loadfile "$@"
