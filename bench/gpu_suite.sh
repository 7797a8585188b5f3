#!/usr/bin/env bash
# Everything this project checks on a lent GPU machine, in priority order, each step under
# its own time limit, results appended to $OUT/gpu_suite.log as they come (a step that runs
# out of time loses only itself). Here first: `bash scripts/device_wheels.sh` (megatron-core, fla into
# .whl/; `--transformers` adds this checkout's transformers), and each device call carries .whl.
# Usage on the GPU machine:
#   bash scripts/device_install.sh && bash bench/gpu_suite.sh [step ...]
# Steps: tests families_tests (the GPU tests of the newer families, LoRA, OPD, dashboard) rollout rollout_plain grpo grpo_async (miles synchronous vs --fully-async on one GPU: step ratio, overlap, idle, staleness)
#        grpo_async_profile (the same, one more step of each profiled: GPU busy time, kernels)
#        grpo_async_process (the same with the engine in its own process on the trainer's GPU)
#        two_gpu_async (needs 2 GPUs: the quickstart --fully-async, engine process on the second GPU) grpo_fast grpo_profile quantized quantized_plain r3 r3_long weight_sync fp8_gemm int4_gemm spec true_on_policy true_on_policy_moe true_on_policy_tests
#        moe_train (GPU tests of the grouped-GEMM training experts, then bench/moe_train.py: MoE fwd+bwd vs the loop and transformers)
#        moe (bench/moe.py: fused MoE vs the per-expert loop, bf16/fp8/int4) moe_sweep (its tile sweep) moe_tests
#        true_on_policy_moe_batched (--moe-invariant-decode batched: its GPU test, then the MoE true on-policy bench)
#        moe_quantized_decode moe_int4_profile (FP8/INT4 vs bf16 MoE decode at b1/b32; INT4 b1 kernels) moe_dsv3 (H200 only) moe_dsv3_h100 (2 layers)
#        moe_dsv3_quantized (the 2-layer DeepSeek-V3 shape, bf16 vs FP8 and INT4, over the latent cache)
#        h200_dsv3 (one H200 call: Qwen3 b1 defaults, MLA GPU tests, the 4-layer DeepSeek-V3 shape)
#        h200_moe (one H200 call: the DeepSeek-V3 shape, then the Qwen3 shape's b1/b32 defaults vs the ones before)
#        moe_sweep_decode (the FP8 / INT4 experts' tile sweep at T = 1 and 32) moe_gemv (the INT4 experts' batch-1 GEMV: tests, decode)
#        decode_switches (--sampler-kernel triton, --moe-combine epilogue, --moe-gemv-tokens 1, --pdl on: their GPU
#                         tests, MoE decode b1/b32 with each and with all)
#        switch_ablation (the decode switches all on, then each one off, then the defaults; the LM head's small-M sweep)
#        decode_defaults (GPU tests of the fused draw, the small-M launches, the sampling graphs, the MoE kernels; bf16 MoE
#                         decode b1/b32 with the defaults, the ones before them and the defaults + epilogue + PDL, twice in turn)
#        small_m_sweep (the small-M GEMM's launches on the decode shapes; MoE decode with the fastest)
#        b1_ab (b1 decode: _baseline/ (an older tree's miles_host and bench), this tree, this tree with --moe-combine epilogue)
#        invariant_matmul (the batch-invariant GEMM vs cuBLAS, us and TFLOP/s per shape) invariant_sweep (its small-M launches)
#        h200_window (an H200 call within an H100's memory: b1 defaults, the expert GEMV sweep, b1 with its fastest
#                     launches, the latent MLA kernel's and latent engine's GPU tests)
#        h200_b1 (on an H200: the expert GEMV and small-M sweeps, then b1 decode with the defaults and with the fastest launches)
#        b1_tests (GPU tests of the b1 decode kernels: expert GEMV + combine, split merge, router, PDL)
#        attention_sweep (the decode attention's split-KV launches)
#        mla_prefill (--mla-prefill expanded vs absorbed: GPU tests, DeepSeek-V3 prefill at 1k / 8k prompts)
#        mla_prefill_long (the same at one 32k prompt: the expanded prefill in key parts)
#        moe_gemv_sweep (the expert GEMV's launches at batch 1) mla_attention_sweep (the latent MLA decode kernel's launches)
#        b1_profile (bf16 MoE b1 decode with the defaults, kernel time per token)
#        pdl (programmatic dependent launch: its GPU tests, bf16 MoE decode b1/b32 with it off and on, the b1 profile)
#        moe_router (one MoE block graph-timed with the fused and the eager router, then bf16 decode b1/b8/b32 with each)
#        sampling_tests (GPU tests of penalties, grammars and logprob extras against the CPU engine)
#        small_m (GPU tests of the small-M FP8/INT4 kernels) quantized_ab (new vs old quantized decode paths)
#        fp8_sweep int4_sweep (every tile/split of the small-M kernels) quickstart_gpu
#        int4_gemv_8b (the one-token GEMV's variants on the 8B linears) int4_decode_8b (bf16 vs int4 decode, 8B: the INT4 >= 1.5x bf16 goal)
#        int4_profile_8b (batch-1 decode of both, GPU kernel time per token by kernel)
#        lora_int4_decode lora_int4_decode_8b (batch-1 decode of LoRA over a bf16 vs an INT4 base, --lora-sync adapter)
#        quantized_8b fp8_gemm_8b int4_gemm_8b (the Qwen3-8B shape: where the decode goals are measured)
#        spec_greedy (speculation at temperature 0, where a draft can learn a random policy)
#        spec_4b (the Qwen3-4B shape, 16 sequences: where a step is weight reading, not kernel launches)
#        spec_4b_peaky (the same with logits of std 10: a trained model's entropy) spec_tests (GPU tests of miles-spec and the sampler)
#        spec_4b_bigram (the 4B shape fine-tuned on a noisy bigram language: a policy with structure a draft can learn)
#        spec_small (16 sequences: the memory-bound regime of a rollout's long tail, where verifying k+1 tokens is ~free)
#        two_gpu (needs 2 GPUs: NCCL broadcast GB/s, the quickstart disaggregated and FSDP2-colocated)
#        h200_goals (lora then megatron_train, unprofiled: one device call)
#        megatron_train megatron_quickstart (one GPU: the megatron trainer vs the native one, tok/s and learning)
#        megatron_moe (its MoE half) megatron_sync (each backend's host syncs in a training phase) step_tests
#        megatron_parallel (needs 2 GPUs: Megatron TP=2, EP=2, PP=2, CP=2, PP2xVPP2 against one process; x4 adds TP2xPP2,
#                           EP2xPP2, DP2xPP2 with the distributed optimizer)
#        scale_x8 / scale_x4 (bench/scale_run.py on 8 / 4 GPUs; longer than one 600 s device call)
#        scale_x1 (the reduced one-GPU version; SCALE_VARIANT=fp8_r3|no_fp8|no_r3, one per call)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
LOG="$OUT/gpu_suite.log"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests rollout rollout_plain grpo quantized r3 weight_sync)
run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v "Writing model shards\|it/s\]" | tee -a "$LOG" | tail -40
  echo "=== $name rc=${PIPESTATUS[0]}" | tee -a "$LOG"
}
quickstart() {  # name, seconds, flags...: the quickstart preset on GPU, then its eval accuracy and timing
  local name=$1 limit=$2
  shift 2
  rm -rf "$OUT/$name"
  run "$name" "$limit" python3 -m miles_host.cli.main run --device cuda --num-rollout 10 --no-progress \
    --output-dir "$OUT/$name" "$@"
  [ -f "$OUT/$name/metrics.jsonl" ] && python3 bench/run_summary.py "$OUT/$name" 2>&1 | tee -a "$LOG"
}
two_gpu() {
  run two_gpu_weight_sync 240 python3 bench/weight_sync.py --two-gpus --repeat 3
  quickstart two_gpu_disaggregated 420 --train-backend fsdp --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
    --rollout-backend process --weight-sync broadcast
  quickstart two_gpu_colocated 420 --train-backend fsdp --actor-num-gpus-per-node 2 --colocate --rollout-backend process
  quickstart two_gpu_colocated_offload 420 --train-backend fsdp --actor-num-gpus-per-node 2 --colocate \
    --rollout-backend process --offload-train --offload-rollout
}
for step in "${steps[@]}"; do
  case $step in
    tests) run tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests ;;
    families_tests) run families_tests 480 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/models \
      tests/kernels/test_dsa.py tests/kernels/test_gated_delta_rule.py tests/rollout/test_qwen_next_gpu.py \
      tests/rollout/test_triton_attention.py tests/lora tests/opd tests/dashboard/test_profiling.py ;;  # GPU tests of the new model families' kernels and engines (DSA, Gated DeltaNet, sinks / chunked attention), LoRA, OPD, the CUDA memory snapshot
    rollout) run rollout 240 python3 bench/rollout.py --repeats 2 ;;
    rollout_plain) run rollout_plain 200 python3 bench/rollout.py --repeats 2 --skip-hf --no-overlap ;;
    grpo) run grpo 420 python3 bench/grpo_step.py --train-compile ;;
    grpo_async) run grpo_async 480 python3 bench/grpo_step.py --train-compile --fully-async --steps 4 ;;  # synchronous, then --fully-async, each in its own process (one process runs out of KV-cache room for the second)
    grpo_async_profile) run grpo_async_profile 560 python3 bench/grpo_step.py --train-compile --fully-async --steps 3 --profile ;;  # both step times (medians after the first) and the GPU busy time of one more step of each: what one GPU leaves to overlap
    grpo_async_process) run grpo_async_process 560 python3 bench/grpo_step.py --train-compile --fully-async --engine-process --steps 3 ;;  # the engine in its own process on the trainer's GPU (--colocate): no shared interpreter lock
    two_gpu_async) quickstart two_gpu_async 420 --fully-async --rollout-num-gpus 1 --rollout-backend process ;;  # needs 2 GPUs
    grpo_fast) run grpo_fast 260 python3 bench/grpo_step.py --train-compile --steps 2 ;;
    lora) run lora 480 python3 bench/lora_step.py --profile ;;  # the full $OUT/gpu_suite.log holds each variant's profiled step (host functions, CUDA kernels)
    h200_goals) run lora_goal 260 python3 bench/lora_step.py  # the LoRA and Megatron goals in one call, unprofiled
      run megatron_goal 310 python3 bench/megatron_train.py --json "$OUT/megatron_train.json" ;;
    megatron_train) run megatron_train 560 python3 bench/megatron_train.py --profile --json "$OUT/megatron_train.json" ;;  # megatron vs native train tok/s, TP = PP = 1, 0.6B dense and the MoE bench shape (needs the megatron-core wheel in .whl/)
    megatron_moe) run megatron_moe 300 python3 bench/megatron_train.py --models moe --profile --json "$OUT/megatron_moe.json" ;;  # the MoE half of megatron_train (the open >= 1.0x item)
    megatron_sync) run megatron_sync 260 python3 bench/megatron_train.py --models moe --steps 2 --sync-points ;;  # each backend's host syncs in one training phase, by where they come from
    step_tests) run step_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/host/test_host_copies.py \
      tests/plugins/megatron/test_megatron_grouped_experts.py tests/plugins/megatron/test_megatron_gpu.py tests/rollout/test_gpu_engine.py ;;  # the training step's sync-free copies, the megatron grouped experts and trainer, routes under overlapped graphs
    megatron_quickstart) quickstart quickstart_native 300; quickstart quickstart_megatron 400 --train-backend megatron ;;  # the quickstart learns with either trainer (eval accuracy, same call)
    lora_int4_decode) run lora_int4_decode 400 python3 bench/quantized_decode.py --repeats 3 --batches 1,8 \
      --precisions bf16,int4 --lora-rank 16 ;;  # batch-1 decode, LoRA (rank 16, every linear, --lora-sync adapter) over a bf16 vs an INT4 base, Qwen3-1.7B shape (goal: INT4 faster at batch 1)
    lora_int4_decode_8b) run lora_int4_decode_8b 400 python3 bench/quantized_decode.py --model 8b --repeats 2 \
      --batches 1 --precisions bf16,int4 --lora-rank 16 ;;  # the same on the Qwen3-8B shape  # LoRA (rank 16, all linears) vs full fine-tune GRPO step on the Qwen3-1.7B shape: step time, peak memory (goals <= 1.0x, <= 0.5x)
    grpo_profile) run grpo_profile 300 python3 bench/grpo_step.py --only miles --train-compile --steps 2 --profile ;;
    quantized) run quantized 300 python3 bench/quantized_decode.py --repeats 2 ;;
    quantized_plain) run quantized_plain 300 python3 bench/quantized_decode.py --repeats 2 --no-overlap ;;
    r3) run r3 150 python3 bench/r3_overhead.py ;;
    r3_long) run r3_long 400 python3 bench/r3_overhead.py --prompts 256 --new-tokens 1024 --repeats 3 ;;  # a rollout of >= 5 s on an H100
    moe) run moe 560 python3 bench/moe.py --json "$OUT/moe.json" ;;
    moe_quantized_decode) run moe_quantized_decode 400 python3 bench/moe.py --precisions bf16,fp8,int4 --kernels fused --batches 1,32 \
      --prefill-seqs 0 --repeats 2 --json "$OUT/moe_quantized_decode.json" ;;  # FP8 / INT4 vs bf16 MoE decode at b1 and b32 on today's decode path
    moe_int4_profile) run moe_int4_profile 300 python3 bench/moe.py --precisions int4 --kernels fused --batches 1 --prefill-seqs 0 \
      --repeats 1 --profile-batch 1 ;;  # INT4 MoE b1 decode: GPU kernel time per token by kernel
    moe_dsv3) run moe_dsv3 480 python3 bench/moe.py --shapes dsv3 --precisions bf16 --kernels fused --repeats 1 \
      --json "$OUT/moe_dsv3.json" ;;  # needs an H200 (run with needs_h200): 4 layers of 256 experts are ~95 GB of bf16 weights
    h200_moe) run mla_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_mla_attention.py \
        tests/models/test_mla_latent_cache.py
      run moe_dsv3 330 python3 bench/moe.py --shapes dsv3 --precisions bf16 --kernels fused --batches 1,32,128,256 \
        --prefill-seqs 8 --repeats 1 --switch mla_kv_cache=latent --json "$OUT/moe_dsv3.json"
      run decode_defaults_1 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --new-tokens 64 --repeats 3
      run decode_before_1 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --new-tokens 64 --repeats 3 --switch sampler_kernel=torch --switch moe_gemv_tokens=0 \
        --switch pdl=off --drop-launch 1x151936x2048 ;;  # one H200 call (needs_h200: the DeepSeek-V3 shape's ~95 GB): that shape's decode and prefill, then the Qwen3-30B-A3B shape's b1/b32 with the defaults and with the ones before them
    h200_dsv3) run b1_defaults 90 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1 --prefill-seqs 0 \
        --new-tokens 256 --repeats 3
      run mla_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_mla_attention.py \
        tests/models/test_mla_latent_cache.py tests/rollout/test_gpu_attention.py
      run moe_dsv3 330 python3 bench/moe.py --shapes dsv3 --precisions bf16 --kernels fused --batches 1,32,128,256 \
        --prefill-seqs 8 --repeats 1 --json "$OUT/moe_dsv3.json" ;;  # one H200 call (needs_h200: the 4-layer DeepSeek-V3 shape's ~95 GB): the Qwen3-30B-A3B shape's b1 decode with the defaults, the MLA GPU tests, then the DeepSeek-V3 shape's decode b1-b256 and prefill over the latent cache
    h200_short) run decode_defaults_1 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --new-tokens 64 --repeats 3
      run mla_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_mla_attention.py \
        tests/models/test_mla_latent_cache.py
      run decode_defaults_2 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --new-tokens 64 --repeats 3
      run moe_dsv3 240 python3 bench/moe.py --shapes dsv3 --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 2 --repeats 1 --switch mla_kv_cache=latent --json "$OUT/moe_dsv3.json" ;;  # a short H200 window (needs_h200 for the last step): the Qwen3-30B-A3B shape's b1/b32 with the defaults twice around the MLA GPU tests, then the 4-layer DeepSeek-V3 shape's b1/b32 over the latent cache
    mla_short) run mla_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_mla_attention.py \
        tests/models/test_mla_latent_cache.py
      run moe_dsv3_short 240 python3 bench/moe.py --shapes dsv3 --layers 2 --precisions bf16 --kernels fused \
        --batches 1,32 --prefill-seqs 2 --repeats 1 --switch mla_kv_cache=latent --json "$OUT/moe_dsv3_short.json" ;;  # a short device window: the MLA GPU tests, then the 2-layer DeepSeek-V3 shape's b1/b32 decode over the latent cache
    moe_dsv3_quantized) for p in bf16 fp8 int4; do PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run "moe_dsv3_$p" 200 \
        python3 bench/moe.py --shapes dsv3 --layers 2 --precisions $p --kernels fused --batches 1,32 --prefill-seqs 2 \
        --repeats 1 --json "$OUT/moe_dsv3_$p.json"; done ;;  # the DeepSeek-V3 shape cut to 2 layers (~47 GB in bf16; FP8 and INT4 built and quantized a layer at a time, so their 16-bit weights never all exist), each precision in its own process (quantizing beside a held bf16 engine ran out of memory), over the latent cache (FP8 kv_b_proj read dequantized)
    b1_profile) run b1_profile 200 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1 --prefill-seqs 0 \
        --new-tokens 64 --repeats 2 --profile-batch 1 --profile-top 45 ;;  # the Qwen3-30B-A3B shape's b1 decode with the defaults: GPU kernel time per token by kernel
    mla_attention_sweep) run mla_attention_sweep 240 python3 -m bench.attention_decode_sweep --mla --heads-q 128 \
        --batches 1,32 --contexts 320,4096 --split-keys 16,32,64 --json "$OUT/mla_attention_sweep.json" ;;  # the latent MLA decode kernel's split counts and keys per iteration (DeepSeek-V3: 128 heads over 512 + 64 latents)
    moe_gemv_sweep) run moe_gemv_sweep 300 python3 -m bench.moe_gemv_sweep --shapes ${GEMV_SHAPES:-qwen3,dsv3} --json "$OUT/moe_gemv_sweep.json" ;;  # the one-pair expert GEMV's launches at batch 1 (Qwen3-30B-A3B and DeepSeek-V3 experts)
    attention_sweep) run attention_sweep 240 python3 -m bench.attention_decode_sweep --batches 1,32 --contexts 320,4096 \
        --json "$OUT/attention_sweep.json" ;;  # the paged-attention decode kernel's split counts and keys per iteration (Qwen3-30B-A3B heads)
    b1_ab) python3 -c "import sys; sys.path.insert(0, '_baseline'); import miles_host; print('baseline:', miles_host.__file__, open('_baseline/COMMIT').read().strip())" | tee -a "$LOG"
      for round in $(seq "${B1_ROUNDS:-2}"); do
        run "b1_baseline_$round" 100 python3 _baseline/bench/moe.py --precisions bf16 --kernels fused --batches 1 \
          --prefill-seqs 0 --new-tokens 256 --repeats 3
        for c in separate epilogue; do run "b1_tree_${c}_$round" 100 python3 bench/moe.py --precisions bf16 --kernels fused \
          --batches 1 --prefill-seqs 0 --new-tokens 256 --repeats 3 --switch moe_combine=$c; done; done ;;  # b1 decode: an older tree's kernels (_baseline/: bash scripts/baseline_tree.sh <commit>, carried), this tree, this tree with --moe-combine epilogue; alternating, B1_ROUNDS times
    h200_window) b1="python3 bench/moe.py --precisions bf16 --kernels fused --batches 1 --prefill-seqs 0 --new-tokens 256 --repeats 3"
      run b1_defaults 90 $b1
      run b1_gemv_sweep 120 python3 -m bench.moe_gemv_sweep --shapes qwen3 --json "$OUT/moe_gemv_sweep.json"
      run b1_gemv_swept 90 $b1 --gemv-table "$OUT/moe_gemv_sweep.json"
      run mla_latent_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/models/test_mla_latent_cache.py tests/kernels/test_mla_attention.py ;;  # one H200 call that fits an H100's memory: b1 decode with the defaults (the >= 60% goal's case), the expert GEMV's launches swept there and b1 with the fastest, then the GPU tests of the latent MLA kernel and the latent engine
    h200_b1) run b1_gemv_sweep 120 python3 -m bench.moe_gemv_sweep --shapes qwen3 --json "$OUT/moe_gemv_sweep.json"
      run b1_small_m_sweep 120 python3 -m bench.small_m_sweep --json "$OUT/small_m_sweep.json"
      b1="python3 bench/moe.py --precisions bf16 --kernels fused --batches 1 --prefill-seqs 0 --new-tokens 256 --repeats 3"
      run b1_defaults 90 $b1
      run b1_swept 90 $b1 --gemv-table "$OUT/moe_gemv_sweep.json" --small-m-table "$OUT/small_m_sweep.json"
      run b1_swept_32_splits 90 $b1 --gemv-table "$OUT/moe_gemv_sweep.json" --small-m-table "$OUT/small_m_sweep.json" \
        --max-decode-splits 32 ;;  # one call where the machine is an H200: the expert GEMV's and the small-M GEMM's launches swept there, then b1 decode (the >= 60% goal's case) with the defaults, with the fastest swept launches, and with those and 32 KV splits
    b1_tests) run b1_tests 330 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_moe_grouped.py \
        tests/rollout/test_gpu_attention.py tests/kernels/test_moe_router.py tests/kernels/test_pdl.py tests/models/test_blocks.py \
        tests/kernels/test_mla_attention.py tests/models/test_mla_latent_cache.py \
        -k "gemv or split or router or pdl or rotary or engine or latent or mla or decode_graphs" ;;  # GPU tests of the batch-1 decode kernels changed: the expert GEMV (+ combine), the split merge, the router, PDL bits, the rotary table, the engine vs transformers, the latent MLA kernel and engine
    mla_prefill) run mla_prefill_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/models/test_mla_latent_cache.py
      run mla_prefill 300 python3 bench/moe.py --shapes dsv3 --layers 2 --precisions bf16 --kernels fused --batches 1 \
        --new-tokens 8 --prefill-seqs 2 --prefill-len 1024,8192 --repeats 2 --prefill-switch mla_prefill=absorbed,expanded \
        --json "$OUT/mla_prefill.json" ;;  # --mla-prefill expanded: its GPU tests (the engine vs transformers both ways), then the 2-layer DeepSeek-V3 shape's prefill tok/s absorbed vs expanded at 1k and 8k prompts
    mla_prefill_long) run mla_prefill_long_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/models/test_mla_latent_cache.py tests/rollout/test_gpu_attention.py
      run mla_prefill_long 300 python3 bench/moe.py --shapes dsv3 --layers 2 --precisions bf16 --kernels fused --batches 1 \
        --new-tokens 8 --prefill-seqs 1 --prefill-len 32768 --repeats 1 --prefill-switch mla_prefill=absorbed,expanded \
        --json "$OUT/mla_prefill_long.json" ;;  # a context past the expanded prefill's 16,384-token bound (in key parts merged by their log-sum-exps): the GPU tests of the paged kernel and the latent engine, then one 32,768-token prompt's prefill absorbed vs expanded (the 2-layer DeepSeek-V3 shape)
    mla_tests) run mla_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_mla_attention.py \
        tests/models/test_mla_latent_cache.py ;;  # the latent MLA kernel against the reference; the engine over latents against transformers
    moe_dsv3_h100) run mla_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_mla_attention.py \
        tests/models/test_mla_latent_cache.py
      run moe_dsv3_h100 400 python3 bench/moe.py --shapes dsv3 --layers 2 --precisions bf16 --kernels fused \
      --batches 1,32,128 --prefill-seqs 4 --repeats 2 --switch mla_kv_cache=latent --json "$OUT/moe_dsv3_h100.json"
      run moe_dsv3_h100_expanded 150 python3 bench/moe.py --shapes dsv3 --layers 2 --precisions bf16 --kernels fused \
      --batches 1,32 --prefill-seqs 0 --repeats 2 --switch mla_kv_cache=expanded ;;  # the MLA tests; the DeepSeek-V3 shape cut to 2 layers (~45 GB of bf16 experts) on an 80 GB GPU, over the latent cache, then decode over the per-head cache
    qwen_next) run qwen_next 400 bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_gated_delta_rule.py tests/rollout/test_qwen_next_gpu.py; python3 bench/qwen_next_decode.py" ;;  # Gated DeltaNet GPU tests (fla if importable) vs the CPU reference and graph vs eager hybrid decode, then decode tok/s of a Qwen3-Next-shaped model (4 layers, real widths) vs its HBM bound incl. the recurrent state
    moe_sweep) for p in bf16 fp8 int4; do run "moe_sweep_$p" 200 python3 bench/moe.py --sweep --sweep-precision $p --json "$OUT/moe_sweep_$p.json"; done ;;
    moe_gemv) run moe_gemv_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/plugins/int4/test_moe_fused.py
      run moe_quantized_decode 320 python3 bench/moe.py --precisions bf16,int4,fp8 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --repeats 2 --mem-fraction 0.5 --json "$OUT/moe_quantized_decode.json"
      run moe_int4_grouped_b1 150 python3 bench/moe.py --precisions int4 --kernels fused --batches 1 --prefill-seqs 0 \
        --repeats 2 --mem-fraction 0.5 --switch int4_moe_gemv_tokens=0 ;;  # the INT4 experts' batch-1 GEMV: its GPU tests, FP8/INT4 vs bf16 decode at b1/b32, INT4 b1 on the grouped kernel (the GEMV's baseline)
    pdl) run pdl_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_pdl.py \
        tests/kernels/test_small_m_gemm.py tests/kernels/test_moe_router.py tests/kernels/test_moe_grouped.py \
        tests/rollout/test_gpu_attention.py tests/models/test_fused_kernels.py tests/plugins/int4
      for p in off on; do run "pdl_$p" 150 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --new-tokens 64 --repeats 3 --switch pdl=$p --json "$OUT/moe_pdl_$p.json"; done
      run pdl_profile 150 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1 --prefill-seqs 0 \
        --new-tokens 64 --repeats 1 --profile-batch 1 --profile-top 45 ;;  # programmatic dependent launch: GPU tests (bits equal on/off), bf16 MoE decode b1/b32 with --pdl off then on, the b1 kernel profile
    decode_switches) run decode_switch_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/kernels/test_fused_sampler.py tests/kernels/test_moe_grouped.py -k "sampler or draw or epilogue or gemv"
      for s in none sampler_kernel=triton moe_combine=epilogue moe_gemv_tokens=1 pdl=on; do
        flags=(); [ "$s" != none ] && flags=(--switch "$s")
        run "decode_$s" 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 --prefill-seqs 0 \
          --new-tokens 64 --repeats 3 "${flags[@]}"; done
      run decode_all 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 --prefill-seqs 0 \
        --new-tokens 64 --repeats 3 --switch sampler_kernel=triton --switch moe_combine=epilogue --switch moe_gemv_tokens=1 --switch pdl=on ;;  # the off-by-default decode switches: their GPU tests, then bf16 MoE decode b1/b32 with each and with all
    switch_ablation) run sampler_gemv_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        tests/kernels/test_fused_sampler.py tests/kernels/test_small_m_gemm.py
      all=(sampler_kernel=triton moe_combine=epilogue moe_gemv_tokens=1 pdl=on)
      off=(sampler_kernel=torch moe_combine=separate moe_gemv_tokens=0 pdl=off)
      for drop in none 0 1 2 3; do
        flags=(); for i in "${!all[@]}"; do
          if [ "$drop" = "$i" ]; then flags+=(--switch "${off[$i]}"); else flags+=(--switch "${all[$i]}"); fi; done
        run "decode_all_but_$drop" 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
          --prefill-seqs 0 --new-tokens 64 --repeats 3 "${flags[@]}"; done
      run decode_defaults 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
        --prefill-seqs 0 --new-tokens 64 --repeats 3
      run small_m_sweep_head 200 python3 -m bench.small_m_sweep --shapes 1x151936x2048,1x2048x4096 --copies 4 \
        --json "$OUT/small_m_sweep_head.json" ;;  # the decode switches all on, then with each one off, then the defaults (bf16 MoE decode b1/b32); the small-M launches on the LM head's and the o projection's shapes
    decode_defaults) run decode_tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -x \
        tests/kernels/test_fused_sampler.py tests/kernels/test_small_m_gemm.py tests/rollout/test_sampling_graphs.py \
        tests/kernels/test_moe_grouped.py
      for round in 1 2; do  # alternating: one configuration's runs spread by up to 13% within a call
        run "decode_defaults_$round" 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
          --prefill-seqs 0 --new-tokens 64 --repeats 3
        run "decode_before_$round" 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
          --prefill-seqs 0 --new-tokens 64 --repeats 3 --switch sampler_kernel=torch --switch moe_gemv_tokens=0 \
          --drop-launch 1x151936x2048
        run "decode_epilogue_pdl_$round" 100 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 \
          --prefill-seqs 0 --new-tokens 64 --repeats 3 --switch moe_combine=epilogue --switch pdl=on; done ;;  # GPU tests of the fused draw, the small-M launches, the sampling graphs and the MoE kernels; then bf16 MoE decode b1/b32 with the defaults, with the ones before (PyTorch draw, grouped experts at b1, cuBLAS LM head) and with the combine epilogue and PDL added, in turn, twice
    small_m_sweep) run small_m_sweep 240 python3 -m bench.small_m_sweep --json "$OUT/small_m_sweep.json"
      run small_m_default 120 python3 bench/moe.py --precisions bf16 --kernels fused --batches 1,32 --prefill-seqs 0 \
        --new-tokens 64 --repeats 3 --switch pdl=off
      for p in off on; do run "small_m_table_pdl_$p" 120 python3 bench/moe.py --precisions bf16 --kernels fused \
        --batches 1,32 --prefill-seqs 0 --new-tokens 64 --repeats 3 --switch pdl=$p --small-m-table "$OUT/small_m_sweep.json"; done ;;  # the small-M GEMM's launches on the decode shapes, then bf16 MoE decode b1/b32 with the default launches and with the fastest swept ones (PDL off, on)
    moe_sweep_decode) for p in fp8 int4; do run "moe_sweep_decode_$p" 150 python3 bench/moe.py --sweep --sweep-precision $p \
      --sweep-tokens 1,32 --json "$OUT/moe_sweep_decode_$p.json"; done ;;  # the quantized experts' decode tiles (T = 1, 32)
    sampling_tests) run sampling_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
      tests/rollout/test_sglang_sampling_params.py ;;  # SGLang's sampling features under CUDA graphs + overlap
    moe_tests) run moe_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_moe_grouped.py tests/kernels/test_moe_router.py tests/plugins/fp8/test_moe_fused.py tests/plugins/int4/test_moe_fused.py ;;
    moe_router) run moe_router_block 120 python3 bench/moe.py --router-timing --json "$OUT/moe_router_block.json"
      run moe_router 400 python3 bench/moe.py --precisions bf16 --kernels fused --routers fused,torch --batches 1,8,32 \
        --prefill-seqs 0 --new-tokens 48 --repeats 3 --json "$OUT/moe_router.json" ;;
    weight_sync) run weight_sync 200 python3 bench/weight_sync.py --repeat 3 ;;
    fp8_gemm) run fp8_gemm 200 python3 bench/fp8_gemm.py ;;
    fp8_gemm_8b) run fp8_gemm_8b 200 python3 bench/fp8_gemm.py --train-model 8b --train-tokens 16384 --model 8b ;;
    int4_gemm_8b) run int4_gemm_8b 120 python3 bench/int4_gemm.py --model 8b --repeats 20 ;;
    quantized_8b) run quantized_8b 330 python3 bench/quantized_decode.py --model 8b --repeats 2 \
      --precisions bf16,int4,fp8,fp8:fp16-products ;;
    int4_gemm) run int4_gemm 200 python3 bench/int4_gemm.py --repeats 20 ;;
    spec) run spec 300 python3 bench/spec_rollout.py ;;
    spec_greedy) run spec_greedy 300 python3 bench/spec_rollout.py --temperature 0 ;;
    spec_small) run spec_small 300 python3 bench/spec_rollout.py --num-prompts 16 --profile ;;  # memory-bound batch (a rollout's tail)
    spec_4b) run spec_4b 400 python3 bench/spec_rollout.py --model 4b --num-prompts 16 --profile ;;  # a memory-bound policy
    spec_4b_greedy) run spec_4b_greedy 400 python3 bench/spec_rollout.py --model 4b --num-prompts 16 --temperature 0 ;;
    spec_4b_bigram) run spec_4b_bigram 400 python3 bench/spec_rollout.py --model 4b --num-prompts 16 --policy bigram ;;
    spec_4b_bigram_hot) run spec_4b_bigram_hot 400 python3 bench/spec_rollout.py --model 4b --num-prompts 16 --policy bigram --hot-vocab 4096 ;;
    spec_4b_peaky) run spec_4b_peaky 400 python3 bench/spec_rollout.py --model 4b --num-prompts 16 --logit-std 10 ;;
    spec_tests) run spec_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/plugins/spec \
      tests/rollout/test_sampling.py tests/rollout/test_gpu_engine.py ;;
    megatron_parallel) MILES_MEGATRON_TEST_DEVICE=cuda run megatron_parallel 420 python3 -m pytest -q -p no:cacheprovider \
      --tb=short tests/plugins/megatron/test_megatron_parallel.py tests/plugins/megatron/test_megatron_context_parallel.py \
      tests/plugins/megatron/test_megatron_virtual_pipeline.py tests/plugins/megatron/test_megatron_distributed_optimizer.py \
      ;;  # 2 GPUs: TP/EP/PP/CP 2, PP2 x VPP2 (4-rank cases, DP2 x PP2 distributed optimizer among them, skip unless 4 GPUs)
    small_m) run small_m 300 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/plugins/fp8/test_decode_gemm.py \
      tests/plugins/int4/test_decode_gemm.py tests/plugins/int4/test_kernels.py tests/plugins/fp8/test_gpu.py ;;
    quantized_ab) run quantized_ab 540 python3 bench/quantized_decode.py --repeats 2 \
      --precisions bf16,int4,fp8,int4:tinygemm,fp8:unfused ;;
    fp8_sweep) run fp8_sweep 580 python3 bench/fp8_gemm.py --decode-only --sweep --iters 10 ;;
    int4_sweep) run int4_sweep 580 python3 bench/int4_gemm.py --sweep --repeats 10 ;;
    int4_gemv_8b) run int4_gemv_8b 300 python3 bench/int4_gemm.py --model 8b --repeats 20 --batch-sizes 1 --sweep ;;
    int4_decode_8b) run int4_decode_8b 240 python3 bench/quantized_decode.py --model 8b --repeats 2 --precisions bf16,int4 ;;
    int4_profile_8b) run int4_profile_8b 200 python3 bench/quantized_decode.py --model 8b --repeats 1 --batches 1 \
      --precisions bf16,int4 --profile ;;
    quickstart_gpu) run quickstart_gpu 300 python3 bench/quickstart_gpu.py ;;
    true_on_policy) run true_on_policy 300 python3 bench/true_on_policy.py --steps 2 ;;
    true_on_policy_moe) run true_on_policy_moe 300 python3 bench/true_on_policy.py --steps 2 --model moe ;;
    true_on_policy_moe_batched) run true_on_policy_moe_batched_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
      --tb=short tests/kernels/test_invariant_experts.py; run true_on_policy_moe_batched 300 python3 bench/true_on_policy.py \
      --steps 2 --model moe --moe-invariant-decode batched ;;  # the batched invariant decode experts: bit-equal on the GPU, then diff 0.0 and cost (flip the switch's default if both hold)
    moe_train) run moe_train_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/kernels/test_moe_train.py
      run moe_train 420 python3 bench/moe_train.py --json "$OUT/moe_train.json" ;;  # grouped vs loop vs transformers
    invariant_sweep) run invariant_sweep 240 python3 -m bench.invariant_matmul --sweep --rows 1,16 --json "$OUT/invariant_sweep.json" ;;  # the batch-invariant GEMM's small-M launches, each checked bit for bit against the tier
    invariant_matmul) run invariant_matmul 200 python3 -m bench.invariant_matmul --json "$OUT/invariant_matmul.json" ;;  # the batch-invariant GEMM vs cuBLAS on the Qwen3-0.6B linears at 1 / 64 / 4096 rows
    true_on_policy_tests) run true_on_policy_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -x \
      tests/kernels tests/true_on_policy/test_gpu_exact.py ;;
    scale_x8) run scale_x8 3500 python3 bench/scale_run.py --gpus 8 --json "$OUT/scale_x8.json" ;;  # needs 8 GPUs
    scale_x1) run scale_x1 580 python3 bench/scale_run.py --gpus 1 --layers 4 --variants "${SCALE_VARIANT:-fp8_r3}" \
      --json "$OUT/scale_x1.json" ;;  # one H200: trainer + embedded engine in one process, 4 layers (stated)
    scale_x4) run scale_x4 3500 python3 bench/scale_run.py --gpus 4 --layers 12 --json "$OUT/scale_x4.json" ;;  # 4 GPUs
    two_gpu) two_gpu ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done
