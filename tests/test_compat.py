"""torchvision on a CPU-only host: ``ensure_torchvision_importable``
(see ``mm_serve.utils._compat``)."""

from __future__ import annotations

import torch

from mm_serve.utils._compat import ensure_torchvision_importable


def test_ensure_torchvision_importable_is_idempotent():
    ensure_torchvision_importable()
    ensure_torchvision_importable()
    import torchvision
    from torchvision.transforms.v2 import functional as tvF

    assert torchvision.__version__
    assert tvF.resize(torch.zeros(3, 4, 4, dtype=torch.uint8), [2, 2]).shape == (3, 2, 2)
    assert hasattr(torch.ops.torchvision, "nms")
    ensure_torchvision_importable()  # after the import: still a no-op
