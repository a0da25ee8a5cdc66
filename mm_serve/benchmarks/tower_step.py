"""The vision tower over one encode step's images: the engine's blocks, whose residual adds ride
in the norms after them (``VisionBlock``), against the same modules with each add and norm a
kernel of its own (HF's form, the engine's before the fusion), in one process on one GPU.

    python -m mm_serve.benchmarks.tower_step [--model-arch qwen2-vl-2b] [--images 26]
        [--height 448 --width 448]

The tower of ``--model-arch`` (its published ``vision_config``) gets random bf16 weights, its
norms random affine parameters, and random pixels for ``--images`` single-frame images (the
grid the Qwen2-VL processors make for that size). Both forms run eagerly, as an encode step of
more than four images does (``worker.tower_graphs``), plan included. Each is checked against
the float32 tower with the reference kernels (relative error), then timed with CUDA events
(median of ``--iters``, the two forms interleaved). Last, the kernels of one engine forward
under the torch profiler, summed by name.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from mm_serve.benchmarks.architectures import _build_config
from mm_serve.config import KernelConfig
from mm_serve.kernels.dispatch import configure_kernels, kernel_config
from mm_serve.models.layers.layernorm import LayerNorm


def build_tower(name: str, device: torch.device) -> torch.nn.Module:
    """The vision tower of architecture ``name`` with random weights (std 0.02; norms around
    1 and 0), float32 on ``device``."""
    from mm_serve.models.registry import get_model_class  # the family's tower_class

    config = _build_config(name, {})
    with device:
        tower = get_model_class(config).tower_class(config.vision_config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param_name, param in tower.named_parameters():
            is_norm = "norm" in param_name or "ln_q" in param_name
            param.normal_(1.0 if is_norm and param_name.endswith("weight") else 0.0, 0.02)
    return tower.eval()


def unfused_run(tower, pixel_values: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
    """``tower.run`` with every residual add and norm a kernel of its own (HF's block form)."""

    def norm(module, x):
        if isinstance(module, LayerNorm):
            return F.layer_norm(x, x.shape[-1:], module.weight, module.bias, module.eps)
        return module(x)

    plan = tower.plan(grids, pixel_values.device)
    x = tower.patch_embed(pixel_values)
    if plan.index is not None:
        from mm_serve.encoders.qwen2_vl import to_window_order

        x = to_window_order(x, plan.index, tower.spatial_merge_size)
    for i, block in enumerate(tower.blocks):
        segments = plan.full if i in tower.fullatt_block_indexes else plan.windows
        x = x + block.attn(norm(block.norm1, x), segments, plan.rotary)
        x = x + block.mlp(norm(block.norm2, x))
    x = tower.merger(x)
    return x if plan.inverse is None else x[plan.inverse]


def time_ms(fn, iters: int) -> list[float]:
    """Device milliseconds of each of ``iters`` calls of ``fn`` (CUDA events)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def kernel_table(fn, top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel name, device ms, calls) of one call of ``fn``, the ``top`` largest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [(e.key[:90], e.self_device_time_total / 1e3, e.count) for e in kernels[:top]]


def gemm_flops(tower: torch.nn.Module, patches: int) -> float:
    """FLOPs of the tower's linear layers over ``patches`` patches (2 per multiply-add; the
    merger's rows are merge windows): the attention's own products are left out."""
    flops = 2.0 * patches * tower.patch_embed.proj.weight.numel()  # [dim, C, T, P, P]
    for name, module in tower.named_modules():
        if isinstance(module, torch.nn.Linear):
            rows = patches // tower.spatial_merge_size**2 if "merger" in name else patches
            flops += 2.0 * rows * module.in_features * module.out_features
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-arch", default="qwen2-vl-2b")
    parser.add_argument("--images", type=int, default=26)
    parser.add_argument("--height", type=int, default=448)
    parser.add_argument("--width", type=int, default=448)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    tower = build_tower(args.model_arch, device)
    unit = tower.patch_embed.proj.weight.shape[-1] * tower.spatial_merge_size  # pixels
    grid = [1, round(args.height / unit) * tower.spatial_merge_size]
    grid.append(round(args.width / unit) * tower.spatial_merge_size)
    grids = [list(grid)] * args.images
    patches = grid[1] * grid[2] * args.images
    pixels = torch.randn(patches, tower.patch_embed.proj.weight[0].numel(), device=device)
    grid_thw = torch.tensor(grids)
    with torch.inference_mode():
        mode = kernel_config()
        configure_kernels(KernelConfig(mode="ref"))
        reference = tower(pixels, grid_thw)  # float32, the reference kernels
        configure_kernels(mode)
        tower, pixels = tower.to(torch.bfloat16), pixels.to(torch.bfloat16)
        forms = {
            "fused": lambda: tower(pixels, grid_thw),
            "unfused": lambda: unfused_run(tower, pixels, grids),
        }
        for name, fn in forms.items():
            err = ((fn().float() - reference).norm() / reference.norm()).item()
            print(f"{name}: relative error against the float32 reference {err:.2e}")
            if not err < 5e-2:
                raise SystemExit(f"The {name} form is wrong: relative error {err:.2e}.")
        for fn in forms.values():
            time_ms(fn, 2)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(2):  # two interleaved rounds
            for name, fn in forms.items():
                times[name] += time_ms(fn, args.iters // 2)
        kernels = kernel_table(forms["fused"])
    flops = gemm_flops(tower, patches)
    print(f"\n{args.model_arch}: {args.images} images, grid {grid} each ({patches} patches)")
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"  {name:8s} {ms:8.2f} ms  (GEMMs {flops / ms / 1e9:.0f} TFLOP/s)")
    print("\nKernels of one fused forward (ms, calls):")
    for name, ms, calls in kernels:
        print(f"  {ms:8.2f} {calls:5d}  {name}")


if __name__ == "__main__":
    main()
