"""This process's kernel mode and PDL switch (``KernelConfig``): set once at start-up by
``configure_kernels`` (the model runner, from ``EngineConfig.kernels``), else read from the
environment on first use. ``dispatch`` reads the mode, ``pdl`` the PDL switch."""

from __future__ import annotations

import os
from dataclasses import dataclass

KERNEL_MODES = ("auto", "triton", "ref")
KERNELS_ENV = "MM_SERVE_KERNELS"  # the default of --kernel-mode


@dataclass(frozen=True)
class KernelConfig:
    """The forward's kernels (``kernels/dispatch.py``: ``mode``; ``kernels/pdl.py``: ``pdl``),
    applied once by the model runner. ``ValueError`` for a mode not in ``KERNEL_MODES``."""

    mode: str = "auto"
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.mode not in KERNEL_MODES:
            raise ValueError(
                f"Kernel mode {self.mode!r} (--kernel-mode, {KERNELS_ENV}): choose one of "
                f"{', '.join(KERNEL_MODES)}."
            )

    @classmethod
    def from_env(cls, mode: str | None = None, pdl: bool | None = None) -> KernelConfig:
        """``mode`` and ``pdl``, where None takes ``MM_SERVE_KERNELS`` (default ``auto``) and
        ``MM_SERVE_PDL`` (off only for ``0``)."""
        if mode is None:
            mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
        return cls(mode, os.environ.get("MM_SERVE_PDL", "1") != "0" if pdl is None else pdl)


# Set by configure_kernels; None until then, and ``KernelConfig.from_env()`` on first use.
_config: KernelConfig | None = None


def configure_kernels(config: KernelConfig) -> None:
    """Set this process's kernel mode and PDL (``pdl.pdl_options``), once at start-up."""
    global _config
    _config = config


def kernel_config() -> KernelConfig:
    """This process's ``KernelConfig`` (``configure_kernels``, else the env defaults)."""
    global _config
    if _config is None:
        _config = KernelConfig.from_env()
    return _config


def kernel_mode() -> str:
    """``auto``, ``triton`` or ``ref``: see ``kernels/dispatch.py``'s module doc."""
    return kernel_config().mode
