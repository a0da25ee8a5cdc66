"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and newer GPUs.

With PDL (CUDA programming guide, "Programmatic Dependent Launch and Synchronization"; PTX
``griddepcontrol``) a kernel launched with ``launch_pdl=True`` may start while its predecessor
still runs. Every kernel here calls :func:`pdl_enter` before its first read of an activation
and its first write: ``griddepcontrol.wait`` blocks until the predecessor finished and its
writes are visible, then ``launch_dependents`` lets the successor launch. Before that a kernel
may only read what no kernel writes: weights and host-filled step inputs (attention metadata,
positions, slot mapping). The edges are kept in CUDA graphs.

``--no-pdl`` (``config.configure_kernels``; ``MM_SERVE_PDL=0`` otherwise) turns it off; it is
off before Hopper and in the interpreter."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from mm_serve.kernels.config import kernel_config

__all__ = ["pdl_enter", "pdl_options"]
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (finished, writes visible), then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _device_supports_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options for a kernel taking ``USE_PDL``: ``USE_PDL`` and, when on,
    ``launch_pdl``. On for CUDA devices of compute capability 9.0+ when PDL is enabled
    (``config.configure_kernels``), except under ``TRITON_INTERPRET=1``."""
    on = (
        device.type == "cuda"
        and kernel_config().pdl
        and not _INTERPRETER
        and _device_supports_pdl(device)
    )
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
