"""Beyond one process: data-parallel training, rollout engines in their own
processes, bucketed broadcast / IPC weight sync, a local launcher and fault detection.

Layout (one node, no Ray)::

    driver process  = trainer rank 0 + the RL loop (rollout manager, rewards, checkpoints)
    trainer ranks 1..N-1 (spawned)  <- commands over a pipe; gradients all-reduced over
                                       a gloo (CPU) / NCCL (GPU) group of the N trainers
    rollout engines 0..M-1 (spawned) <- RPC over a pipe (submit / step / abort / weights);
                                       weights by broadcast over a second group
                                       {trainer rank 0, engines} or by shared handles (IPC)

``--colocate``: engine j shares a trainer's GPU and the phases take turns on it
(:mod:`miles_host.phases`: engines release their KV cache while training, trainers
offload with ``--offload-train``).

Entry point: :func:`miles_host.distributed.launcher.run_distributed`.
"""

from miles_host.distributed.errors import WorkerFailed

__all__ = ["WorkerFailed"]
