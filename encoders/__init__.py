"""Vision towers and image processors (Qwen2-VL, Qwen2.5-VL, CLIP/LLaVA)."""
