"""Weight-sync time, trainer process -> rollout process, same run:

- ``ipc``: CUDA IPC handles through a pipe, the receiver copies from the trainer's
  GPU memory (miles' ``cuda_ipc`` transport; on CPU: shared memory, one copy);
- ``serialize``: ``torch.save`` bytes through the pipe, ``torch.load`` + copy on the
  receiver (what an HTTP / disk path does, minus the socket / file);
- ``broadcast``: flat buckets of ``--bucket-mb`` over a 2-rank group (NCCL on GPU,
  gloo on CPU) (miles' ``broadcast`` transport).

The receiver holds same-shaped tensors and ``copy_``s into them, as the engine's
``update_weights`` does. Shapes: Qwen3-0.6B and Qwen3-1.7B (tied embeddings).

    python bench/weight_sync.py                # GPU: 0.6B and 1.7B, bf16
    python bench/weight_sync.py --tiny         # CPU smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # hidden, layers, intermediate, heads, kv heads, head dim, vocab
    "tiny": (64, 2, 128, 4, 2, 16, 14),
    "qwen3-0.6b": (1024, 28, 3072, 16, 8, 128, 151936),
    "qwen3-1.7b": (2048, 28, 6144, 16, 8, 128, 151936),
}


def named_shapes(kind: str) -> list[tuple[str, tuple[int, ...]]]:
    h, layers, inter, heads, kv, hd, vocab = SHAPES[kind]
    out = [("embed_tokens.weight", (vocab, h)), ("norm.weight", (h,))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
            (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
            (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
            (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    return out


class Receiver:
    """The rollout side: same-shaped tensors, loaded by ``copy_``."""

    def __init__(self, kind: str, dtype: str, device: str):
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.weights = {n: torch.empty(s, dtype=self.dtype, device=self.device) for n, s in named_shapes(kind)}
        self.group = None

    def _copy(self, named):
        for name, tensor in named:
            self.weights[name].copy_(tensor)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return True

    def load_shared(self, named):
        ok = self._copy(named)
        del named
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()
        return ok

    def load_serialized(self, payload: bytes):
        import io

        return self._copy(torch.load(io.BytesIO(payload), map_location=self.device, weights_only=True).items())

    def init_group(self, port: int, backend: str):
        from miles_host.distributed.comm import new_group

        self.group = new_group("127.0.0.1", port, 1, 2, backend, 120)
        return True

    def receive_broadcast(self, meta):
        from miles_host.distributed.comm import broadcast_

        dev = self.device if self.group_backend == "nccl" else torch.device("cpu")
        for entries in meta:
            flat = torch.empty(sum(n for _, n in entries), dtype=self.dtype, device=dev)
            broadcast_(self.group, flat, 0)
            offset, named = 0, []
            for name, numel in entries:
                named.append((name, flat[offset : offset + numel].view(self.weights[name].shape)))
                offset += numel
            self._copy(named)
        return True

    def set_group_backend(self, backend):
        self.group_backend = backend
        return True


def receiver_main(kind, dtype, device, conn):
    from miles_host.distributed.comm import serve

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    target = Receiver(kind, dtype, device)
    conn.send(("ok", None))
    serve(conn, target)


def bench(kind: str, args) -> dict:
    import torch.multiprocessing as mp

    from miles_host.distributed.comm import WorkerHandle, broadcast_, free_port, new_group
    from miles_host.distributed.rollout_worker import serialize
    from miles_host.distributed.transports import bucketize

    cuda = torch.cuda.is_available() and not args.tiny
    dtype = "bfloat16" if cuda else "float32"
    send_dev = "cuda:0" if cuda else "cpu"
    recv_dev = ("cuda:1" if torch.cuda.device_count() > 1 and args.two_gpus else "cuda:0") if cuda else "cpu"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(kind, dtype, recv_dev, child), daemon=True)
    proc.start()
    handle = WorkerHandle("receiver", proc, parent, 600)
    handle.recv("start-up")
    named = [(n, torch.randn(s, device=send_dev).to(getattr(torch, dtype))) for n, s in named_shapes(kind)]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    results = {"model": kind, "bytes": nbytes, "dtype": dtype, "sender": send_dev, "receiver": recv_dev}

    shm: dict = {}

    def ipc():
        if cuda:
            torch.cuda.synchronize()
            return handle.call("load_shared", named)
        for name, t in named:  # CPU stand-in: one copy into shared memory
            if name not in shm:
                shm[name] = torch.empty_like(t).share_memory_()
            shm[name].copy_(t)
        return handle.call("load_shared", list(shm.items()))

    def ser():
        return handle.call("load_serialized", serialize(named))

    cases = [("ipc", ipc), ("serialize", ser)]
    if cuda and recv_dev == send_dev:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): broadcast needs --two-gpus
        results["broadcast_s"] = results["broadcast_GBps"] = None
    else:
        backend = "nccl" if cuda else "gloo"
        handle.call("set_group_backend", backend)
        port = free_port()
        handle.send("init_group", port, backend)
        group = new_group("127.0.0.1", port, 0, 2, backend, 120)
        handle.recv("init_group")
        buckets = bucketize(named, args.bucket_mb << 20)
        meta = [[(n, t.numel()) for n, t in entries] for _, entries in buckets]

        def bcast():
            handle.send("receive_broadcast", meta)
            for _, entries in buckets:
                broadcast_(group, torch.cat([t.reshape(-1) for _, t in entries]), 0)
            return handle.recv("receive_broadcast")

        cases.append(("broadcast", bcast))

    for label, fn in cases:
        times = []
        for i in range(args.warmup + args.repeat):
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        results[f"{label}_s"] = statistics.median(times)
        results[f"{label}_GBps"] = nbytes / statistics.median(times) / 1e9
    results["serialize_over_ipc"] = results["serialize_s"] / results["ipc_s"]
    handle.stop()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny shape")
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=sorted(SHAPES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--two-gpus", action="store_true", help="receiver on cuda:1 (disaggregated)")
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    models = ["tiny"] if args.tiny else args.models
    rows = []
    for kind in models:  # print each model's row when it is done: a time limit keeps what finished
        rows.append(bench(kind, args))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
