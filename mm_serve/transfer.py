"""Host-to-device copies that never block the host.

A copy from pageable host memory makes CUDA synchronise the stream first: the host waits for
every kernel already queued (for example the step still running under async scheduling).
Staged through pinned memory, the copy is queued like a kernel instead.
"""

from __future__ import annotations

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
