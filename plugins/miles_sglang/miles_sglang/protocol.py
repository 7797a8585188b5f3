"""SGLang's wire formats, for both ends: routed experts, errors, tensor payloads.

Routed experts (``meta_info.routed_experts``): base64 of the int32 array
``[prompt + completion - 1, layers, top_k]`` in C order, as SGLang sends it; the
reader needs ``top_k`` to reshape (layers are inferred from the size, so a server
that reports every layer and one that reports only MoE layers both decode).

Tensor payloads of ``/update_weights_from_tensor``: SGLang sends
``serialized_named_tensors[tp_rank]`` = base64 of a ``ForkingPickler`` pickle,
either a list of ``(name, tensor)`` or, with ``load_format="flattened_bucket"``,
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}``.
Over HTTP the tensors are CUDA IPC handles, which only work on one GPU host. So
that no arbitrary pickle is ever loaded from a request:

- the *safetensors* encoding (miles' CPU-capable equivalent): base64 of a
  safetensors file. ``flattened_bucket``: one uint8 tensor ``flattened_tensor``
  and the metadata list as JSON in the file's ``metadata["metadata"]``; otherwise
  the named tensors themselves. safetensors has no code execution.
- the *pickle* encoding (what real SGLang clients send) goes through
  :class:`RestrictedUnpickler`, which resolves only tensor-handle rebuild
  functions, dtypes and the bucket metadata class; anything else is a
  ``ValueError`` (HTTP 400).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

#: the ``load_format`` values ``/update_weights_from_tensor`` accepts
TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")


# ----------------------------------------------------------------------------
# errors and routed experts
# ----------------------------------------------------------------------------


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error JSON (``_create_error_response``): ``{"error": {"message": ...}}``."""
    return {"error": {"message": str(message)}}


def encode_routed_experts(routes_TLK: np.ndarray | None) -> str | None:
    """int32 ``[tokens - 1, layers, top_k]`` -> base64 string (SGLang's HTTP form)."""
    if routes_TLK is None:
        return None
    return base64.b64encode(np.ascontiguousarray(routes_TLK, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, num_rows: int, top_k: int) -> np.ndarray:
    """base64 int32 -> ``[num_rows, layers, top_k]``; ValueError naming what does not fit."""
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError, TypeError) as error:
        raise ValueError(f"meta_info.routed_experts is not base64 int32 data: {error}") from error
    per_row = num_rows * top_k
    if num_rows <= 0 or top_k <= 0 or flat.size % per_row:
        raise ValueError(
            f"meta_info.routed_experts has {flat.size} ids, not a multiple of "
            f"(prompt + completion - 1 = {num_rows}) x (top_k = {top_k})"
        )
    return flat.reshape(num_rows, flat.size // per_row, top_k).copy()


# ----------------------------------------------------------------------------
# flattened tensor buckets
# ----------------------------------------------------------------------------


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor lives in a flattened uint8 bucket (SGLang's field names)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / a dtype -> the torch dtype (ValueError if unknown)."""
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Concatenate tensors' bytes into one uint8 tensor (mixed dtypes allowed)."""
    if not named_tensors:
        raise ValueError("cannot build an empty tensor bucket")
    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tuple(tensor.shape), tensor.dtype, offset, offset + flat.numel(), flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), metadata


def unflatten_bucket(flat: torch.Tensor, metadata: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`flatten_bucket`; metadata entries may be objects or dicts."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be a 1-D uint8 tensor, got {tuple(flat.shape)} {flat.dtype}")
    out = []
    for meta in metadata:
        get = meta.get if isinstance(meta, dict) else lambda key, m=meta: getattr(m, key)
        try:
            name, start, end = str(get("name")), int(get("start_idx")), int(get("end_idx"))
            shape, dtype = tuple(int(s) for s in get("shape")), parse_dtype(get("dtype"))
        except (AttributeError, KeyError, TypeError) as error:
            raise ValueError(f"bad flattened_bucket metadata entry {meta!r}: {error}") from error
        if not 0 <= start <= end <= flat.numel():
            raise ValueError(f"flattened_bucket metadata of {name!r} points outside the bucket ({start}:{end} of {flat.numel()})")
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


# ----------------------------------------------------------------------------
# safetensors encoding (CPU-capable, no pickle)
# ----------------------------------------------------------------------------


def encode_tensor_payload(named_tensors: Sequence[tuple[str, torch.Tensor]], load_format: str | None = "flattened_bucket") -> str:
    """One ``serialized_named_tensors`` entry in the safetensors encoding (base64 string)."""
    from safetensors.torch import save

    cpu = [(name, t.detach().to("cpu").contiguous()) for name, t in named_tensors]
    if load_format == "flattened_bucket":
        flat, metadata = flatten_bucket(cpu)
        meta = [{"name": m.name, "shape": list(m.shape), "dtype": dtype_name(m.dtype), "start_idx": m.start_idx,
                 "end_idx": m.end_idx, "numel": m.numel} for m in metadata]
        data = save({"flattened_tensor": flat}, metadata={"metadata": json.dumps(meta)})
    else:
        data = save(dict(cpu))
    return base64.b64encode(data).decode("ascii")


def _looks_like_safetensors(data: bytes) -> bool:
    if len(data) < 9:
        return False
    (header_len,) = struct.unpack("<Q", data[:8])
    return 0 < header_len <= len(data) - 8 and data[8:9] == b"{"


def _decode_safetensors(data: bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as error:  # noqa: BLE001 - safetensors raises several types
        raise ValueError(f"serialized_named_tensors entry is not a valid safetensors payload: {error}") from error
    if load_format != "flattened_bucket":
        return list(tensors.items())
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    raw = (header.get("__metadata__") or {}).get("metadata")
    if "flattened_tensor" not in tensors or raw is None:
        raise ValueError("a flattened_bucket payload needs a 'flattened_tensor' tensor and metadata['metadata']")
    return unflatten_bucket(tensors["flattened_tensor"], json.loads(raw))


# ----------------------------------------------------------------------------
# SGLang's pickle encoding, through a restricted unpickler
# ----------------------------------------------------------------------------

_ALLOWED_REBUILDS = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only tensor handles (CUDA IPC / shared-memory file names), dtypes,
    ``torch.Size`` and SGLang's ``FlattenedTensorMetadata``; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_REBUILDS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        raise ValueError(
            f"refused to unpickle {module}.{name}: only tensor handles and bucket metadata are accepted "
            "in serialized_named_tensors"
        )


def _decode_pickle(data: bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    try:
        obj = RestrictedUnpickler(io.BytesIO(data)).load()
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - a stale IPC handle fails in many ways
        raise ValueError(f"could not rebuild the pickled tensors: {type(error).__name__}: {error}") from error
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise ValueError("a flattened_bucket payload must be {'flattened_tensor': ..., 'metadata': [...]}")
        return unflatten_bucket(obj["flattened_tensor"], obj["metadata"])
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in obj
    ):
        raise ValueError("a pickled payload must be a list of (name, tensor) pairs")
    return [(str(name), tensor) for name, tensor in obj]


def decode_tensor_payload(entry: str | bytes, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One ``serialized_named_tensors`` entry -> ``[(name, tensor)]`` (either encoding)."""
    if load_format not in TENSOR_LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use one of {list(TENSOR_LOAD_FORMATS)}")
    if isinstance(entry, str):
        try:
            data = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"serialized_named_tensors entry is not base64: {error}") from error
    elif isinstance(entry, (bytes, bytearray)):
        data = bytes(entry)
    else:
        raise ValueError(f"serialized_named_tensors entries must be base64 strings, got {type(entry).__name__}")
    if _looks_like_safetensors(data):
        return _decode_safetensors(data, load_format)
    if data[:1] == b"\x80":
        return _decode_pickle(data, load_format)
    raise ValueError("serialized_named_tensors entry is neither a safetensors file nor a pickle")


def encode_cuda_ipc_payload(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SGLang's own encoding for a colocated GPU server: a flattened bucket of CUDA
    IPC handles, pickled with ``ForkingPickler`` (what ``MultiprocessingSerializer`` does)."""
    from multiprocessing.reduction import ForkingPickler

    if not all(t.is_cuda for _, t in named_tensors):
        raise ValueError("the cuda_ipc weight encoding needs CUDA tensors; use the safetensors encoding on CPU")
    flat, metadata = flatten_bucket(named_tensors)
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buffer.getvalue()).decode("ascii")
