"""Stopping a run without losing work, and keeping its outputs its own.

- :class:`StopSignals`: SIGINT, SIGTERM and SIGHUP (Ctrl-C, SLURM / Kubernetes /
  ``docker stop``, a closed ssh session) all stop the loop the same way: a
  :class:`Stopped` exception (a ``KeyboardInterrupt``) that the loop answers with a
  checkpoint of the last completed rollout; the process exits with ``128 + signal``
  (130, 143, 129). A signal that arrives while a checkpoint is being written waits
  until the write is done.
- :class:`SaveLock`: one run at a time per ``--save`` directory (an ``flock``, released
  by the kernel when the process ends, however it ends).
- :func:`remove_partial_files`: ``*.tmp`` files a killed save left behind.
- :func:`fresh_metrics_file`: a reused ``--output-dir`` keeps its old ``metrics.jsonl``
  under another name instead of appending a second run's rows to it.
- :class:`OutputWriteError`: a checkpoint or metrics file that could not be written,
  naming the path and the disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

#: signals that stop a run with a checkpoint
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by ``signum``; the process exits with :attr:`exit_code`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum


class StopSignals:
    """While entered (main thread only), the stop signals raise :class:`Stopped`;
    inside :meth:`saving` they are held until the save is done."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._saving = 0
        self._pending: int | None = None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self._saving:
            self._pending = self._pending or signum
            print(f"miles: {signal.Signals(signum).name} received while a checkpoint is being written; "
                  "stopping once it is complete", file=sys.stderr, flush=True)
            return
        raise Stopped(signum)

    @contextlib.contextmanager
    def saving(self, stopping: bool = False) -> Iterator[None]:
        """Hold stop signals while the block writes a checkpoint. One that arrived is raised
        when the block ends, unless ``stopping`` (the run is already stopping)."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
        if self._saving == 0 and self._pending is not None and not stopping:
            signum, self._pending = self._pending, None
            raise Stopped(signum)


class OutputWriteError(RuntimeError):
    """A checkpoint or a metrics file could not be written (disk full, permissions, ...)."""


def describe_disk(path: Path) -> str:
    """``the disk mounted at M (F free of T)`` for the file system holding ``path``."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    mount = existing
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        usage = shutil.disk_usage(existing)
    except OSError:
        return f"the disk mounted at {mount}"
    return f"the disk mounted at {mount} ({usage.free / 2**30:.2f} GiB free of {usage.total / 2**30:.1f} GiB)"


def write_error(what: str, path: Path, error: BaseException) -> OutputWriteError:
    """An :class:`OutputWriteError` for ``what`` at ``path`` that names the disk when it is full."""
    reason = getattr(error, "strerror", None) or str(error)
    no_space = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(error)
    where = f" on {describe_disk(path)}" if no_space else ""
    return OutputWriteError(f"{what}: writing {path} failed{where}: {reason}")


def remove_partial_files(directory: Path) -> list[Path]:
    """Delete ``*.tmp`` files directly in ``directory`` and in its ``iter_*`` folders
    (what a save killed mid-write leaves); the paths removed."""
    directory = Path(directory)
    removed = []
    for pattern in ("*.tmp", "iter_*/*.tmp"):
        for path in directory.glob(pattern):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


class SaveLock:
    """An exclusive lock on ``<save>/miles.lock`` for the life of a run."""

    NAME = "miles.lock"

    def __init__(self, directory: str):
        import fcntl

        self.path = Path(directory) / self.NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a+")  # noqa: SIM115 - held open for the run
        try:
            fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._handle.seek(0)
            holder = self._handle.read().strip() or "unknown"
            self._handle.close()
            raise ValueError(
                f"--save {directory} is in use by another run (pid {holder}, lock {self.path}); two runs "
                "saving to one directory would overwrite each other's checkpoints: give this run its own --save"
            ) from None
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(str(os.getpid()))
        self._handle.flush()

    def release(self) -> None:
        """Unlock (idempotent)."""
        if not self._handle.closed:
            import fcntl

            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()


def fresh_metrics_file(path: Path, resuming: bool) -> Path | None:
    """Before a run writes ``path`` (``metrics.jsonl``): a file left by an earlier run in the
    same ``--output-dir`` is renamed to ``metrics.<n>.jsonl`` (returned), unless the run
    resumes (``--load``), whose rows continue the earlier ones."""
    path = Path(path)
    if resuming or not path.is_file() or path.stat().st_size == 0:
        return None
    number = 1
    while (kept := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists():
        number += 1
    path.rename(kept)
    print(f"miles: warning: {path.parent} already held a metrics.jsonl (another run's); kept as {kept.name}, "
          "this run writes a fresh one", file=sys.stderr)
    return kept
