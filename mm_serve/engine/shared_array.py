"""Arrays handed between the front end and its preprocessing workers through ``/dev/shm``.

A process pool pickles its arguments and results through a pipe, which moves a large array a
pipe buffer (64 KiB) at a time, each a wake-up of the other side: a 448x448 image in and its
1.2 MB of patches out took ~8 ms of a 9 ms preprocessing round trip on an H100 host, for
0.9 ms of work. An array parked in a file of the shared-memory file system crosses with one
write and one read instead; the pipe carries only its path.

The file is readable by its owner alone (0600) and lives until the other side takes it
(``take`` unlinks it); ``discard`` removes one that will never be taken.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
# Smaller arrays go through the pipe as they are: a file costs more than it saves.
MIN_PARKED_BYTES = 64 << 10


@dataclass(frozen=True)
class SharedArray:
    """A C-contiguous array parked in the file ``path`` (``park``), to be read once."""

    path: str
    shape: tuple[int, ...]
    dtype: str  # numpy's ``dtype.str``, e.g. ``"|u1"``

    @staticmethod
    def park(array: np.ndarray) -> SharedArray | np.ndarray:
        """``array`` parked in a new file, or ``array`` itself when it is small or the
        system has no ``/dev/shm``."""
        if array.nbytes < MIN_PARKED_BYTES or not os.path.isdir(SHM_DIR):
            return array
        path = os.path.join(SHM_DIR, f"mm_serve-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            np.ascontiguousarray(array).tofile(file)
        return SharedArray(path, tuple(array.shape), array.dtype.str)

    def take(self) -> np.ndarray:
        """The array (a fresh copy in this process); the file is gone afterwards.

        Raises:
            FileNotFoundError: it was taken or discarded already.
        """
        try:
            return np.fromfile(self.path, dtype=np.dtype(self.dtype)).reshape(self.shape)
        finally:
            discard(self.path)


def discard(path: str) -> None:
    """Remove a parked array's file, if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def take_if_parked(value: SharedArray | np.ndarray) -> np.ndarray:
    """``value.take()`` for a parked array, ``value`` otherwise."""
    return value.take() if isinstance(value, SharedArray) else value
