"""Weight-sync transports to SGLang servers.

- ``sglang_tensor``: buckets of ``--update-weight-buffer-size`` bytes through
  ``/update_weights_from_tensor`` (safetensors-encoded on CPU, CUDA IPC handles
  with ``--sglang-weight-encoding cuda_ipc`` on a colocated GPU).
- ``sglang_disk``: an HF checkpoint in ``<output_dir>/weight_sync`` and
  ``/update_weights_from_disk`` (servers on the same filesystem; the fallback).
- ``sglang_distributed``: a process group the servers join; tensors broadcast
  from the trainer (NCCL on GPU, gloo on CPU), for disaggregated servers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterable

import torch


def _sglang_backend(backend: Any, transport: str) -> Any:
    if not hasattr(backend, "clients"):
        raise ValueError(f"--weight-sync {transport} needs --rollout-backend sglang (got {type(backend).__name__})")
    return backend


class TensorTransport:
    """Bucketed ``/update_weights_from_tensor`` pushes."""

    def __init__(self, config: Any):
        self.config = config

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Send every tensor, the last bucket carrying ``weight_version``."""
        return _sglang_backend(backend, "sglang_tensor").update_weights(named_tensors, weight_version=weight_version)


class DiskTransport:
    """Save an HF checkpoint, then ``/update_weights_from_disk`` on every server."""

    def __init__(self, config: Any):
        self.config = config

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Write ``model.safetensors`` (HF names) + ``config.json`` and have the servers load it."""
        from safetensors.torch import save_file

        from miles_sglang.weights import native_to_hf

        backend = _sglang_backend(backend, "sglang_disk")
        directory = Path(self.config.output_dir) / "weight_sync"
        directory.mkdir(parents=True, exist_ok=True)
        named = native_to_hf([(n, t.detach()) for n, t in named_tensors], backend.family, backend.model_config)
        tensors = {name: t.contiguous().cpu() for name, t in named}
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        shutil.copyfile(Path(self.config.hf_checkpoint) / "config.json", directory / "config.json")
        body = {"model_path": str(directory.resolve()), "weight_version": None if weight_version is None else str(weight_version)}
        for client in backend.clients:
            answer = client.request("POST", "/update_weights_from_disk", body)
            if isinstance(answer, dict) and answer.get("success") is False:
                raise RuntimeError(f"{client.url}/update_weights_from_disk failed: {answer.get('message')}")
        backend._weight_version = weight_version
        return weight_version


class DistributedTransport:
    """Broadcast from the trainer to every server over a process group the servers
    join (``/init_weights_update_group``, then ``/update_weights_from_distributed``
    per bucket of ``--update-weight-buffer-size`` bytes): NCCL on GPU, gloo on CPU.
    For servers on other GPUs or nodes, where tensors cannot be shared."""

    group_name = "miles_weight_update"

    def __init__(self, config: Any):
        self.config = config
        self.group = None

    def _ensure_group(self, backend: Any) -> None:
        import datetime
        import threading

        import torch.distributed as dist

        from miles_host.distributed.comm import tcp_store
        from miles_sglang.launcher import free_port

        if self.group is not None:
            return
        kind = "nccl" if torch.cuda.is_available() else "gloo"
        port, world = free_port(), 1 + len(backend.clients)
        timeout = datetime.timedelta(seconds=120)
        store = tcp_store("127.0.0.1", port, world, True, timeout)  # listens on loopback only
        answers: list = [None] * len(backend.clients)

        def join(i, client):
            body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": i + 1, "world_size": world,
                    "group_name": self.group_name, "backend": kind}
            answers[i] = client.request("POST", "/init_weights_update_group", body)

        threads = [threading.Thread(target=join, args=(i, c), daemon=True) for i, c in enumerate(backend.clients)]
        for thread in threads:
            thread.start()
        group_class = dist.ProcessGroupGloo if kind == "gloo" else dist.ProcessGroupNCCL
        self.group = group_class(store, 0, world, timeout)
        self.store = store
        for thread in threads:
            thread.join(timeout=130)
        for client, answer in zip(backend.clients, answers):
            if not (isinstance(answer, dict) and answer.get("success")):
                self.group = None
                raise RuntimeError(f"{client.url}/init_weights_update_group failed: {answer}")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], backend: Any, weight_version: Any) -> Any:
        """Broadcast every tensor bucket by bucket; the last bucket sets ``weight_version``."""
        import threading

        import torch.distributed as dist

        from miles_sglang.backend import split_buckets
        from miles_sglang.weights import native_to_hf

        backend = _sglang_backend(backend, "sglang_distributed")
        self._ensure_group(backend)
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        if self.config.sglang_weight_names == "hf":
            named = native_to_hf(named, backend.family, backend.model_config)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        buckets = split_buckets(named, self.config.update_weight_buffer_size)
        version = None if weight_version is None else str(weight_version)
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            body = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                    "flush_cache": last, "weight_version": version if last else None}
            answers: list = [None] * len(backend.clients)

            def post(i, client, body=body, answers=answers):
                answers[i] = client.request("POST", "/update_weights_from_distributed", body)

            threads = [threading.Thread(target=post, args=(i, c), daemon=True) for i, c in enumerate(backend.clients)]
            for thread in threads:
                thread.start()
            for _, tensor in bucket:
                options = dist.BroadcastOptions()
                options.rootRank = 0
                self.group.broadcast([tensor.to(device).contiguous()], options).wait()
            for thread in threads:
                thread.join(timeout=self.config.sglang_request_timeout)
            for client, answer in zip(backend.clients, answers):
                if not (isinstance(answer, dict) and answer.get("success")):
                    raise RuntimeError(f"{client.url}/update_weights_from_distributed failed: {answer}")
        backend._weight_version = weight_version
        return weight_version
