"""Vision towers against HF transformers: same random weights (loaded by name, strict), same
inputs, several images of different sizes in one call."""

from __future__ import annotations

import sys

import pytest
import torch


def _ensure_torchvision_importable() -> None:
    """Some transformers vision modules import torchvision, whose compiled ops fail to load on
    this CPU host; registering the two op schemas it checks for lets the import succeed."""
    try:
        from mm_serve.utils._compat import ensure_torchvision_importable
    except ImportError:
        pass
    else:
        ensure_torchvision_importable()
        return
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _ensure_torchvision_importable.lib = lib  # keep the registration alive


_ensure_torchvision_importable()

from transformers import LlavaConfig, LlavaForConditionalGeneration  # noqa: E402
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VLVisionConfig,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
)

from mm_serve.encoders.clip import (  # noqa: E402
    CLIPVisionTower,
    LlavaMultiModalProjector,
    tower_weight_name,
)
from mm_serve.encoders.qwen2_5_vl import Qwen2_5_VisionTransformer, window_index  # noqa: E402
from mm_serve.encoders.qwen2_vl import Qwen2VisionTransformer  # noqa: E402
from mm_serve.worker.tower_graphs import split_batch  # noqa: E402
from tests.fixtures.vlm_checkpoints import LLAVA_VISION, TINY_TEXT  # noqa: E402

ATOL = RTOL = 1e-5
# Grids in patches (t, h, w); Qwen2.5's window is 56 px = 2x2 merged tokens = 4x4 patches, so
# all but the first image span several windows, some cut at the edges; t=2 is a 2-frame clip.
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 10), (2, 4, 4), (1, 6, 10)]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter (norm weights and biases too) random, std 0.2, so a wrong name, layout
    or formula cannot hide behind HF's identity-like init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _qwen_inputs(config, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random flattened patches ``[sum(t*h*w), C*T*P*P]`` and ``grid_thw [num_images, 3]``."""
    grid_thw = torch.tensor(grids)
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    gen = torch.Generator().manual_seed(1)
    return torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=gen), grid_thw


def _qwen2_config() -> Qwen2VLVisionConfig:
    return Qwen2VLVisionConfig(
        depth=2, embed_dim=32, num_heads=2, hidden_size=64, patch_size=14, temporal_patch_size=2
    )


def _qwen2_5_config() -> Qwen2_5_VLVisionConfig:
    return Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=64,
        window_size=56,
        fullatt_block_indexes=[1, 3],
    )


def _pair(hf_cls, ours_cls, config, dtype=torch.float32):
    """The HF tower with random weights and ours loaded from its state dict (strict, by name)."""
    torch.manual_seed(0)
    hf = hf_cls._from_config(config).eval()
    _randomize(hf, seed=0)
    ours = ours_cls(config).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf.to(dtype), ours.to(dtype)


QWEN_TOWERS = pytest.mark.parametrize(
    "hf_cls, ours_cls, make_config",
    [
        (Qwen2VisionTransformerPretrainedModel, Qwen2VisionTransformer, _qwen2_config),
        (Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VisionTransformer, _qwen2_5_config),
    ],
    ids=["qwen2_vl", "qwen2_5_vl"],
)


@QWEN_TOWERS
@torch.inference_mode()
def test_qwen_tower_matches_hf(hf_cls, ours_cls, make_config):
    config = make_config()
    hf, ours = _pair(hf_cls, ours_cls, config)
    pixel_values, grid_thw = _qwen_inputs(config, GRIDS)
    expected = hf(pixel_values, grid_thw=grid_thw).pooler_output
    out = ours(pixel_values, grid_thw)
    merge = config.spatial_merge_size
    assert out.shape == (pixel_values.shape[0] // merge**2, expected.shape[-1])
    assert expected.abs().max() > 0.1  # not a trivially small output
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)

    # Each image alone gives its rows of the batched result: attention never crosses images.
    start = 0
    for i, (t, h, w) in enumerate(GRIDS):
        rows = t * h * w
        alone = ours(pixel_values[start : start + rows], grid_thw[i : i + 1])
        stop = start // merge**2 + alone.shape[0]
        torch.testing.assert_close(alone, out[start // merge**2 : stop], atol=ATOL, rtol=RTOL)
        start += rows


@QWEN_TOWERS
@torch.inference_mode()
def test_qwen_tower_bf16(hf_cls, ours_cls, make_config):
    config = make_config()
    hf, ours = _pair(hf_cls, ours_cls, config, dtype=torch.bfloat16)
    pixel_values, grid_thw = _qwen_inputs(config, GRIDS)
    expected = hf(pixel_values, grid_thw=grid_thw).pooler_output
    out = ours(pixel_values, grid_thw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_split_batch_chunks_runs_of_one_grid():
    photo, wide = (1, 32, 32), (1, 52, 92)  # 1,024 and 4,784 patches
    assert split_batch([photo] * 27, 16384) == [(0, 16, True), (16, 8, True), (24, 3, True)]
    mixed = [photo] * 2 + [wide] * 4 + [photo]  # 4 wide images pass 16,384 patches: 3 + 1
    assert split_batch(mixed, 16384) == [(0, 2, True), (2, 3, True), (5, 1, True), (6, 1, True)]
    assert split_batch([wide] * 2 + [photo], 4096) == [(0, 2, False), (2, 1, True)]
    assert split_batch([], 4096) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@QWEN_TOWERS
@torch.inference_mode()
def test_tower_graph_chunks_match_one_eager_forward(hf_cls, ours_cls, make_config):
    from mm_serve.worker.tower_graphs import EncoderCudaGraphs

    config = make_config()
    _, ours = _pair(hf_cls, ours_cls, config, dtype=torch.bfloat16)
    ours.cuda()
    grids = [(1, 8, 8)] * 6 + [(1, 4, 6)] * 2 + [(2, 4, 4)] + [(1, 8, 8)] * 5
    pixel_values, grid_thw = _qwen_inputs(config, grids)
    pixel_values = pixel_values.to("cuda", torch.bfloat16)
    expected = ours(pixel_values, grid_thw)
    # chunks: 4 + 2, 2, 1, 4 + 1; a key is captured when met twice
    runner = EncoderCudaGraphs(ours, max_patches=4 * 64, capture_after=2)
    chunks = split_batch(grids, runner.max_patches)
    assert [count for _, count, _ in chunks] == [4, 2, 2, 1, 4, 1]
    # Keys met once run in one eager forward; 4 x (1, 8, 8), met twice, is captured.
    first = runner(pixel_values, grids)
    assert len(runner.graphs) == 1 and runner.num_eager == 1 and runner.num_replays == 1
    second = runner(pixel_values * 0.5, grids)  # met again: captured, then replayed
    assert len(runner.graphs) == 5 and runner.num_replays == 1 + len(chunks)
    torch.testing.assert_close(first, expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(second, ours(pixel_values * 0.5, grid_thw), atol=3e-2, rtol=3e-2)
    # Two images of a new size between graphed ones: replays, and one eager forward for them.
    mixed = grids[:6] + [(1, 6, 4)] * 2 + grids[6:]
    pixel_values, grid_thw = _qwen_inputs(config, mixed)
    pixel_values = pixel_values.to("cuda", torch.bfloat16)
    out = runner(pixel_values, mixed)
    assert runner.num_eager == 2 and runner.num_replays == 1 + 2 * len(chunks)
    torch.testing.assert_close(out, ours(pixel_values, grid_thw), atol=3e-2, rtol=3e-2)


def test_window_index_matches_hf():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 4, 6), (1, 8, 8), (2, 12, 6), (1, 16, 18)]
    for window_size in (56, 112):
        expected_index, expected_cu = get_vision_window_index(
            torch.tensor(grids), spatial_merge_size=2, window_size=window_size, patch_size=14
        )
        index, cu = window_index([list(g) for g in grids], 2, window_size, 14)
        assert torch.equal(index, expected_index)
        assert cu == expected_cu.tolist()


def test_qwen_bad_grid_raises():
    config = _qwen2_config()
    ours = Qwen2VisionTransformer(config)
    pixel_values, grid_thw = _qwen_inputs(config, [(1, 4, 6)])
    with pytest.raises(ValueError, match="rows"):
        ours(pixel_values[:-4], grid_thw)
    with pytest.raises(ValueError, match="multiples"):
        ours(pixel_values[:20], torch.tensor([[1, 4, 5]]))


def _llava(feature_layer, strategy: str) -> LlavaForConditionalGeneration:
    config = LlavaConfig(
        vision_config=LLAVA_VISION,  # CLIP's default activation, quick_gelu
        text_config={**TINY_TEXT, "model_type": "llama", "vocab_size": 64},
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        image_token_id=63,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    _randomize(model, seed=0)
    return model


@pytest.mark.parametrize(
    "feature_layer, strategy",
    [(-2, "default"), (-1, "full"), ([-3, -1], "default"), ([0, 2], "full")],
)
@torch.inference_mode()
def test_clip_tower_and_projector_match_hf_llava(feature_layer, strategy):
    hf = _llava(feature_layer, strategy)
    config = hf.config
    tower = CLIPVisionTower(config.vision_config, feature_layer, strategy).eval()
    projector = LlavaMultiModalProjector(config).eval()
    # transformers 5 names the tower ``model.vision_tower.embeddings...`` (no ``vision_model``).
    tower_state, projector_state = {}, {}
    for name, tensor in hf.state_dict().items():
        if name.startswith("model.vision_tower."):
            tower_state[tower_weight_name(name.removeprefix("model.vision_tower."))] = tensor
        elif name.startswith("model.multi_modal_projector."):
            projector_state[name.removeprefix("model.multi_modal_projector.")] = tensor
    tower.load_state_dict(tower_state, strict=True)
    projector.load_state_dict(projector_state, strict=True)

    pixel_values = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    features = tower(pixel_values)
    num_layers = 1 if isinstance(feature_layer, int) else len(feature_layer)
    assert features.shape == (3, 16 + (strategy == "full"), 32 * num_layers)

    hidden_states = hf.model.vision_tower(pixel_values, output_hidden_states=True).hidden_states
    layers = [feature_layer] if isinstance(feature_layer, int) else feature_layer
    selected = [
        hidden_states[i][:, 1:] if strategy == "default" else hidden_states[i] for i in layers
    ]
    torch.testing.assert_close(features, torch.cat(selected, dim=-1), atol=ATOL, rtol=RTOL)

    expected = hf.model.get_image_features(
        pixel_values, vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy
    ).pooler_output
    torch.testing.assert_close(projector(features), torch.stack(expected), atol=ATOL, rtol=RTOL)


def test_clip_runs_only_needed_layers():
    hf = _llava(-2, "default")
    tower = CLIPVisionTower(hf.config.vision_config, -2, "default")
    assert tower.num_layers_to_run == 2
    assert (
        tower_weight_name("vision_model.pre_layrnorm.weight") == "vision_model.pre_layrnorm.weight"
    )
    assert tower_weight_name("pre_layrnorm.weight") == "vision_model.pre_layrnorm.weight"
    with pytest.raises(ValueError, match="out of range"):
        CLIPVisionTower(hf.config.vision_config, -5, "default")
    with pytest.raises(ValueError, match="strategy"):
        CLIPVisionTower(hf.config.vision_config, -2, "cls")
    with pytest.raises(ValueError, match="56x56"):
        tower(torch.zeros(1, 3, 28, 28))


@torch.inference_mode()
def test_clip_tower_bf16():
    hf = _llava(-2, "default")
    tower = CLIPVisionTower(hf.config.vision_config, -2, "default")
    state = {
        tower_weight_name(k.removeprefix("model.vision_tower.")): v
        for k, v in hf.state_dict().items()
        if k.startswith("model.vision_tower.")
    }
    tower.load_state_dict(state, strict=True)
    hf_tower = hf.model.vision_tower.to(torch.bfloat16)
    pixel_values = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    out = tower.to(torch.bfloat16)(pixel_values)
    expected = hf_tower(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
