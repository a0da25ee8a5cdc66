"""Host-to-device copies that never block the host.

A copy from pageable host memory makes CUDA synchronise the stream first: the host waits for
every kernel already queued (for example the step still running under async scheduling).
Staged through pinned memory, the copy is queued like a kernel instead.
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, queued without blocking the host.

    On CUDA it is staged through pinned memory; PyTorch's caching host allocator keeps the
    staging buffer until its copy is done, so ``tensor`` may change right after. Elsewhere it
    is returned as it is, or moved with a plain copy.
    """
    if device.type != "cuda":
        return tensor.to(device)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


_NUMPY_DTYPES = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}
_TORCH_DTYPES = {np.dtype(np_dtype): dtype for dtype, np_dtype in _NUMPY_DTYPES.items()}
_ALIGN = 16  # bytes between packed arrays: every dtype's view stays aligned


def _strides(array: np.ndarray) -> tuple[int, ...]:
    """A C-contiguous array's strides in elements."""
    return tuple(stride // array.itemsize for stride in array.strides)


class StepUpload:
    """A step's host arrays, packed into one buffer and sent to the device in one copy.

    ``stage`` writes an array into the host buffer and returns its tensor on the device at
    once: a view into the device buffer that holds the array once ``flush`` has queued the
    copy. Kernels that read a staged tensor must be queued after ``flush``. Each ``flush``
    starts new buffers, so the views already handed out keep their contents.

    One copy replaces a pinned allocation, a copy and an event per array (a dozen per decode
    step): on CUDA the host buffer is pinned memory from PyTorch's caching host allocator,
    which keeps it until its copy is done, and the device buffer comes from the caching
    allocator, ordered on the current stream. An array that does not fit goes on its own
    (``host_to_device``) and the buffers grow for the next step.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 18) -> None:
        self.device = device
        self.capacity = -(-capacity // _ALIGN) * _ALIGN  # bytes: a view of any dtype fits
        self._host: torch.Tensor | None = None  # [capacity] uint8
        self._host_bytes: np.ndarray | None = None  # the same memory, for numpy's writes
        self._device_views: dict[torch.dtype, torch.Tensor] = {}  # the device buffer, by dtype
        self._used = 0  # bytes, aligned
        self._overflow = 0  # bytes that did not fit since the last flush

    def stage(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``array`` (converted to ``dtype``) as a device tensor of its shape, valid once
        ``flush`` has run."""
        array = np.ascontiguousarray(array, dtype=_NUMPY_DTYPES.get(dtype))
        start, end = self._used, self._used + array.nbytes
        if end > self.capacity:
            self._overflow += array.nbytes
            return host_to_device(torch.from_numpy(array.copy()), self.device)
        if self._host is None:
            self._allocate()
        self._host_bytes[start:end] = array.reshape(-1).view(np.uint8)
        self._used = -(-end // _ALIGN) * _ALIGN
        dtype = _TORCH_DTYPES.get(array.dtype) or torch.from_numpy(array[:0]).dtype
        if dtype not in self._device_views:
            self._device_views[dtype] = self._device_views[torch.uint8].view(dtype)
        view = self._device_views[dtype]
        return view.as_strided(array.shape, _strides(array), start // array.itemsize)

    def _allocate(self) -> None:
        pin = self.device.type == "cuda"
        self._host = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        self._host_bytes = self._host.numpy()
        device_buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self._device_views = {torch.uint8: device_buffer}

    def flush(self) -> None:
        """Queue the copy of everything staged since the last flush (non-blocking on CUDA)."""
        if self._used:
            device_part = self._device_views[torch.uint8][: self._used]
            device_part.copy_(self._host[: self._used], non_blocking=self.device.type == "cuda")
        if self._overflow:
            self.capacity = 1 << (self.capacity + self._overflow - 1).bit_length()
        self._host = self._host_bytes = None
        self._device_views = {}
        self._used = self._overflow = 0
