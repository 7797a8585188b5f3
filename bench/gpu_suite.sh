#!/usr/bin/env bash
# Everything this project checks on a lent GPU machine, in priority order, each step under
# its own time limit, results appended to $OUT/gpu_suite.log as they come (a step that runs
# out of time loses only itself). Usage on the device (see /work/.library/device):
#   bash scripts/device_install.sh && bash bench/gpu_suite.sh [step ...]
# Steps: tests rollout rollout_overlap grpo grpo_profile quantized r3 weight_sync fp8_gemm int4_gemm spec true_on_policy
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
LOG="$OUT/gpu_suite.log"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests rollout rollout_overlap grpo quantized r3 weight_sync)
run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v "Writing model shards\|it/s\]" | tee -a "$LOG" | tail -40
  echo "=== $name rc=${PIPESTATUS[0]}" | tee -a "$LOG"
}
for step in "${steps[@]}"; do
  case $step in
    tests) run tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests ;;
    rollout) run rollout 240 python3 bench/rollout.py --repeats 2 ;;
    rollout_overlap) run rollout_overlap 200 python3 bench/rollout.py --repeats 2 --skip-hf --overlap ;;
    grpo) run grpo 420 python3 bench/grpo_step.py --train-compile ;;
    grpo_profile) run grpo_profile 300 python3 bench/grpo_step.py --only miles --train-compile --steps 2 --profile ;;
    quantized) run quantized 300 python3 bench/quantized_decode.py --repeats 2 ;;
    r3) run r3 150 python3 bench/r3_overhead.py ;;
    weight_sync) run weight_sync 200 python3 bench/weight_sync.py --repeat 3 ;;
    fp8_gemm) run fp8_gemm 200 python3 bench/fp8_gemm.py ;;
    int4_gemm) run int4_gemm 200 python3 bench/int4_gemm.py --repeats 20 ;;
    spec) run spec 300 python3 bench/spec_rollout.py ;;
    true_on_policy) run true_on_policy 300 python3 bench/true_on_policy.py --steps 2 ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done
