#!/usr/bin/env bash
# Put an older commit's miles_host and bench in _baseline/ (ignored by git), for the device's A/B runs
# (gpu_suite b1_ab runs _baseline/bench/moe.py against bench/moe.py); carry it: run(carry=[".whl", "_baseline"]).
# Usage: bash scripts/baseline_tree.sh <commit>
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: bash scripts/baseline_tree.sh <commit>}
rm -rf _baseline
mkdir _baseline
git archive "$commit" miles_host bench | tar -x -C _baseline
echo "$commit" > _baseline/COMMIT
echo "_baseline/: miles_host and bench of $(git rev-parse --short "$commit")"
