"""Vision towers and image processors (Qwen2-VL, Qwen2.5-VL, CLIP/LLaVA)."""

from mm_serve.utils._compat import ensure_torchvision_importable

# The processors resize with torchvision, as transformers' default processors do; make it
# importable on a CPU host whose torchvision wheel is a CUDA build.
ensure_torchvision_importable()
