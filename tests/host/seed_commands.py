"""Every command line of the miles / slime usage guide the flags follow (its quick start,
FP8, INT4, R3, speculative and true-on-policy sections), paths replaced.

Kept as data so the dry-run test and the docs agree on what "slime compatible"
means. ``{ckpt}`` and ``{data}`` are replaced by real paths in the test.
"""

SEED_COMMANDS = [
    # 快速开始
    """python train.py --advantage-estimator grpo --model-name qwen3-30b-a3b
       --hf-checkpoint {ckpt} --rollout-batch-size 512 --n-samples-per-prompt 8""",
    # 工作流 1
    """python train.py --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --hf-checkpoint {ckpt}
       --advantage-estimator grpo --tensor-model-parallel-size 8 --expert-model-parallel-size 4
       --prompt-data {data} --num-rollout 3000""",
    # 工作流 2 步骤 1
    """python train.py --actor-num-gpus-per-node 8 --hf-checkpoint {ckpt}
       --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3
       --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4
       --sglang-speculative-draft-model-path {ckpt} --advantage-estimator grpo --prompt-data {data}""",
    # 工作流 2 步骤 2 (added to the step-1 command)
    """python train.py --actor-num-gpus-per-node 8 --hf-checkpoint {ckpt}
       --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3
       --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4
       --advantage-estimator grpo --prompt-data {data}
       --mtp-num-layers 1 --enable-mtp-training --mtp-loss-scaling-factor 0.2""",
    # 配置参考: 集群资源
    """miles run --actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8
       --rollout-num-gpus-per-engine 2 --colocate --hf-checkpoint {ckpt}""",
    # 配置参考: Megatron 并行策略
    """miles run --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2
       --expert-model-parallel-size 4 --hf-checkpoint {ckpt}""",
    # 配置参考: 推测解码
    """miles run --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3
       --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 4
       --sglang-enable-draft-weights-cpu-backup --sglang-speculative-draft-model-path {ckpt}""",
    # 配置参考: 在线 MTP 训练
    """miles run --mtp-num-layers 1 --enable-mtp-training --mtp-loss-scaling-factor 0.2""",
    # 常见问题: FP8 训练崩溃 / 推测解码草稿漂移 / 训练与推理不匹配
    """miles run --lr 5e-7""",
    """miles run --sglang-speculative-num-steps 2""",
    """miles run --sglang-enable-draft-weights-cpu-backup""",
    """miles run --use-tis --tis-threshold 0.9""",
    # several feature plugins at once
    """miles run --plugins fp8,r3,spec""",
]
