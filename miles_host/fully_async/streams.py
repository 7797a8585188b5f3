"""The producer's own CUDA stream, for an engine in the trainer's process.

PyTorch's current stream is per thread but every thread starts on the device's default
stream: without a stream of its own, the producer's decode steps and the trainer's
kernels would queue on one stream and run one after the other, and each decode step's
read of its tokens would wait for the training work queued before it. On its own stream
the producer's kernels run beside the trainer's. A weight push reads the trainer's
parameters: it waits for the trainer's stream first and finishes before the trainer's
next optimizer step can change them.

Engines in other processes (``--rollout-num-gpus``), CPU runs and HTTP backends need none
of this: :meth:`ProducerStream.for_backend` gives a stream that does nothing then.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


class ProducerStream:
    """A CUDA stream for the producer's thread, or nothing (``stream`` None)."""

    def __init__(self, stream: "torch.cuda.Stream | None"):
        self.stream = stream

    @classmethod
    def for_backend(cls, backend: Any) -> "ProducerStream":
        """A stream on the device of ``backend``'s in-process engine, when that is a GPU."""
        engine = getattr(backend, "engine", None)  # the embedded backend's Engine; others run elsewhere
        device = getattr(engine, "device", None)
        if device is None or torch.device(device).type != "cuda":
            return cls(None)
        return cls(torch.cuda.Stream(device=torch.device(device)))

    def context(self) -> contextlib.AbstractContextManager:
        """The producer's thread works on the stream inside this context."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def use_on_this_thread(self) -> None:
        """Make the stream current for the calling thread (an engine thread of its own)."""
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)

    def after_trainer(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a weight push, an evaluation) on the producer's stream once the trainer's
        queued work is done, and finished before it returns."""
        if self.stream is None:
            return fn()
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
            result = fn()
        self.stream.synchronize()
        return result
