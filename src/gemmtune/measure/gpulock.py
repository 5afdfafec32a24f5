"""Exclusive use of one GPU while candidates run and are timed.

Workers of one tuner take turns through a thread lock; other processes (a second tuner on the
same GPU, `gemmtune bench`) through an advisory file lock per GPU, which the kernel releases if
the holder dies. A GPU is named as CUDA_VISIBLE_DEVICES names it (an index or a UUID), so
processes that name one GPU differently do not see each other's lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from pathlib import Path

from gemmtune import _env


def gpu_label(index: int) -> str:
    """How CUDA_VISIBLE_DEVICES names the process's CUDA device ``index`` (its own index when
    the variable is unset): the name the tuner's workers lock their GPU under."""
    visible = _env.visible_devices() or []
    return visible[index] if index < len(visible) else str(index)


class GpuLock:
    """``with lock:`` holds GPU ``gpu`` for this thread and process. ``gpu == "cpu"`` takes only
    the thread lock: CPU timings of interpreted kernels are not shared-resource sensitive."""

    def __init__(self, gpu: str):
        self.gpu = gpu
        self._thread_lock = threading.Lock()
        self._fd: int | None = None
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", gpu)
        self.path = None if gpu == "cpu" else _env.lock_dir() / f"gpu-{safe}.lock"

    def __enter__(self) -> GpuLock:
        self._thread_lock.acquire()
        if self.path is None:
            return self
        try:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def _open(self) -> int:
        """The lock file, created for everyone: the folder sticky and world-writable like /tmp,
        the file world-readable; flock needs only a read descriptor, so another user's lock file
        serves as well."""
        folder = self.path.parent
        try:
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                _chmod_quietly(folder, 0o1777)
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)
        except PermissionError as e:
            raise RuntimeError(f"cannot open the GPU lock {self.path} ({e}): another user's "
                               f"lock folder? Set GEMMTUNE_LOCK_DIR to a folder every tuner on "
                               f"this machine can write") from e
        _chmod_quietly(self.path, 0o666)
        return fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._thread_lock.release()


def _chmod_quietly(path: Path, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except OSError:  # not ours: its owner set it up already
        pass
