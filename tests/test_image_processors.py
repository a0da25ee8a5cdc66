"""Our image processors against transformers' default ones (AutoImageProcessor): same pixels.

Processor configs are written by HF's own classes (``save_pretrained``: the image processor's
own ``preprocessor_config.json``, or a whole processor's ``processor_config.json`` with the
settings nested, as transformers 5 saves checkpoints), or by hand where released checkpoints
hold values transformers no longer writes (top-level ``min_pixels``, int sizes); images are
real photographs shipped inside matplotlib / scikit-image plus generated edge cases in every
PIL mode.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from mm_serve.utils._compat import ensure_torchvision_importable

ensure_torchvision_importable()  # before anything imports transformers' image processors

from mm_serve.encoders.clip_processor import CLIPImageProcessor  # noqa: E402
from mm_serve.encoders.image_io import load_image, to_rgb  # noqa: E402
from mm_serve.encoders.processors import get_image_processor  # noqa: E402
from mm_serve.encoders.qwen2_vl_processor import Qwen2VLImageProcessor, smart_resize  # noqa: E402
from tests.fixtures.vlm_checkpoints import (  # noqa: E402
    LAYOUTS,
    QWEN_MAX_PIXELS,
    build_tiny_vlm_checkpoint,
)

ATOL = 1e-5
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64


def _package_file(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


PHOTOS = {
    "grace_hopper": ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),  # RGB JPEG
    "astronaut": ("skimage", "data/astronaut.png"),
    "coffee": ("skimage", "data/coffee.png"),
    "chelsea": ("skimage", "data/chelsea.png"),
    "rocket": ("skimage", "data/rocket.jpg"),
    "camera": ("skimage", "data/camera.png"),  # L
    "horse": ("skimage", "data/horse.png"),  # RGBA
    "logo": ("matplotlib", "mpl-data/sample_data/logo2.png"),  # RGBA, wide
    "gif": ("skimage", "data/no_time_for_that_tiny.gif"),  # P, 14x25
}


def _noise(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """Random pixels (the hardest case for resampling) converted to ``mode``."""
    rng = np.random.default_rng(seed + width * 7919 + height)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "RGBA":
        return rgba
    if mode == "P_transparent":
        image = rgba.convert("RGB").quantize(16)
        image.info["transparency"] = 3
        return image
    if mode == "P":
        return rgba.convert("RGB").quantize(64)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 300, (height, width), dtype=np.uint16))
    return rgba.convert("RGB").convert(mode)


GENERATED = [
    (1, 1, "RGB"),
    (2, 3, "RGB"),
    (28, 28, "RGB"),
    (27, 29, "RGBA"),
    (1000, 40, "RGB"),
    (40, 1000, "L"),
    (333, 77, "P"),
    (77, 333, "P_transparent"),
    (120, 90, "CMYK"),
    (64, 48, "LA"),
    (50, 70, "I;16"),
    (201, 3, "RGB"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny tensor ops on a 2-core host are slowed ~20x by spinning OpenMP workers.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    found = {}
    for name, (package, relative) in PHOTOS.items():
        path = _package_file(package, relative)
        if path is not None:
            found[name] = load_image(path)
    if len(found) < len(PHOTOS):
        pytest.skip("matplotlib and scikit-image (test dependencies) ship the photographs")
    for width, height, mode in GENERATED:
        found[f"{mode}_{width}x{height}"] = _noise(width, height, mode)
    return found


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2VLImageProcessor as HFQwen2VLImageProcessor

    path = tmp_path_factory.mktemp("qwen2_vl")
    HFQwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen25_legacy_dir(tmp_path_factory) -> Path:
    """Only ``preprocessor_config.json`` (the hub's older layout), as the image processor's
    own ``save_pretrained`` writes it, with a Qwen2.5-VL-like pixel range and statistics."""
    from transformers import Qwen2VLImageProcessor as HFQwen2VLImageProcessor

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    HFQwen2VLImageProcessor(
        min_pixels=28 * 28 * 2,
        max_pixels=28 * 28 * 40,
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.25, 0.3],
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    from transformers import CLIPImageProcessor as HFCLIPImageProcessor

    path = tmp_path_factory.mktemp("clip")
    HFCLIPImageProcessor(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def clip_legacy_dir(tmp_path_factory) -> Path:
    """Crop larger than the resize (the padding path), saved by HF's own ``save_pretrained``."""
    from transformers import CLIPImageProcessor as HFCLIPImageProcessor

    path = tmp_path_factory.mktemp("clip_legacy")
    HFCLIPImageProcessor(size=40, crop_size=48).save_pretrained(path)
    return path


def hf_processor(path: Path):
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(path)
    # transformers 5 defaults to the torchvision backend when torchvision imports.
    assert processor.backend == "torchvision"
    return processor


def llava_config(strategy: str = "default"):
    from transformers import LlavaConfig

    vision = {"model_type": "clip_vision_model", "image_size": 64, "patch_size": 16}
    return LlavaConfig(vision_config=vision, vision_feature_select_strategy=strategy)


@functools.cache
def hf_composites_alpha() -> bool:
    """Whether the installed transformers composites transparency onto white, as we do.

    transformers 5.23 does; earlier releases (4.x, 5.17 on the GPU image) only
    ``convert("RGB")``, which drops alpha and keeps the colours stored under it.
    """
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    try:
        rgb = convert_to_rgb(clear, return_numpy=True)
    except TypeError:  # no return_numpy before the compositing version
        rgb = convert_to_rgb(clear)
    return np.asarray(rgb).reshape(-1).tolist() == [255, 255, 255]


def hf_input(image: Image.Image) -> Image.Image:
    """The image to give HF: as is, or already RGB where HF would not composite alpha (then
    the test still checks every step after the RGB conversion)."""
    return image if hf_composites_alpha() else to_rgb(image)


def assert_same_qwen(ours: Qwen2VLImageProcessor, hf, image: Image.Image, **hf_kwargs) -> None:
    expected = hf(hf_input(image), return_tensors="pt", **hf_kwargs)
    got = ours.preprocess(image)
    grid = tuple(expected["image_grid_thw"][0].tolist())
    assert got.image_grid_thw == grid
    assert got.num_tokens == math.prod(grid) // hf.merge_size**2
    assert got.num_tokens == ours.num_tokens(image.height, image.width)
    assert got.pixel_values.dtype == torch.float32
    assert got.pixel_values.shape == expected["pixel_values"].shape
    assert (got.pixel_values - expected["pixel_values"]).abs().max().item() <= ATOL


def assert_same_clip(ours: CLIPImageProcessor, hf, image: Image.Image) -> None:
    expected = hf(hf_input(image), return_tensors="pt")["pixel_values"][0]
    got = ours.preprocess(image).pixel_values
    assert got.dtype == torch.float32
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= ATOL


def test_qwen2_vl_matches_hf(images, qwen_dir):
    ours = get_image_processor(str(qwen_dir), SimpleNamespace(model_type="qwen2_vl"))
    hf = hf_processor(qwen_dir)
    for image in images.values():
        assert_same_qwen(ours, hf, image)


def test_qwen2_5_vl_legacy_config_matches_hf(images, qwen25_legacy_dir):
    from transformers import Qwen2_5_VLConfig

    ours = get_image_processor(str(qwen25_legacy_dir), Qwen2_5_VLConfig())
    assert (ours.min_pixels, ours.max_pixels) == (28 * 28 * 2, 28 * 28 * 40)
    hf = hf_processor(qwen25_legacy_dir)
    for name in ("astronaut", "horse", "camera", "RGB_1x1", "RGB_201x3", "CMYK_120x90"):
        assert_same_qwen(ours, hf, images[name])


def test_max_pixels_override_changes_grid(images, qwen_dir):
    config = SimpleNamespace(model_type="qwen2_vl")
    default = get_image_processor(str(qwen_dir), config)
    small = get_image_processor(str(qwen_dir), config, max_pixels=28 * 28 * 16)
    image = images["grace_hopper"]
    grid_default = default.preprocess(image).image_grid_thw
    grid_small = small.preprocess(image).image_grid_thw
    assert grid_small != grid_default
    assert grid_small[1] * grid_small[2] * 14 * 14 <= 28 * 28 * 16
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": 28 * 28 * 16}
    assert_same_qwen(small, hf_processor(qwen_dir), image, size=size)

    # min_pixels is clamped to a max_pixels below it.
    tiny = get_image_processor(str(qwen_dir), config, max_pixels=28 * 28 * 2)
    assert tiny.min_pixels == tiny.max_pixels == 28 * 28 * 2
    _, grid_h, grid_w = tiny.preprocess(image).image_grid_thw
    assert grid_h * grid_w * 14 * 14 <= 28 * 28 * 2


def test_smart_resize_bounds():
    assert smart_resize(600, 512, 28, MIN_PIXELS, MAX_PIXELS) == (224, 196)
    assert smart_resize(1, 1, 28, MIN_PIXELS, MAX_PIXELS) == (56, 56)
    for height, width in [(1, 199), (37, 1000), (2000, 3000), (29, 29)]:
        h, w = smart_resize(height, width, 28, MIN_PIXELS, MAX_PIXELS)
        assert h % 28 == 0 and w % 28 == 0 and MIN_PIXELS <= h * w <= MAX_PIXELS
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 28, MIN_PIXELS, MAX_PIXELS)
    with pytest.raises(ValueError, match="no pixels"):
        smart_resize(0, 10, 28, MIN_PIXELS, MAX_PIXELS)


def test_clip_matches_hf(images, clip_dir, clip_legacy_dir):
    ours = get_image_processor(str(clip_dir), llava_config("default"))
    assert isinstance(ours, CLIPImageProcessor)
    assert ours.num_tokens == (64 // 16) ** 2
    assert get_image_processor(str(clip_dir), llava_config("full")).num_tokens == 17
    hf = hf_processor(clip_dir)
    for image in images.values():
        assert_same_clip(ours, hf, image)
    legacy = get_image_processor(str(clip_legacy_dir), llava_config())
    # Older hub files give size and crop_size as ints; they mean the same as the dicts.
    as_ints = CLIPImageProcessor.from_config({"size": 40, "crop_size": 48}, legacy.num_tokens)
    assert (as_ints.size, as_ints.crop_size) == (legacy.size, legacy.crop_size)
    hf_legacy = hf_processor(clip_legacy_dir)
    for name in ("chelsea", "logo", "RGB_1x1", "RGB_1000x40", "L_40x1000", "P_333x77"):
        assert_same_clip(legacy, hf_legacy, images[name])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_checkpoint_layouts_match_hf(images, tmp_path, family, layout):
    """A checkpoint as transformers 5 saves it (settings inside processor_config.json) and in
    the hub's older layout (preprocessor_config.json): the same pixels as HF from the folder."""
    from transformers import AutoConfig

    path = build_tiny_vlm_checkpoint(tmp_path, family, layout=layout)
    assert (tmp_path / "preprocessor_config.json").is_file() == (layout == "legacy")
    ours = get_image_processor(path, AutoConfig.from_pretrained(path))
    hf = hf_processor(Path(path))
    for name in ("grace_hopper", "RGBA_27x29", "RGB_1000x40"):
        if family == "llava":
            assert_same_clip(ours, hf, images[name])
        else:
            assert ours.max_pixels == QWEN_MAX_PIXELS
            assert_same_qwen(ours, hf, images[name])


def test_nested_settings_take_precedence(images, tmp_path):
    """With both files present, transformers reads processor_config.json's nested settings."""
    from transformers import AutoConfig
    from transformers import Qwen2VLImageProcessor as HFQwen2VLImageProcessor

    path = build_tiny_vlm_checkpoint(tmp_path, "qwen2_vl")
    HFQwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=28 * 28 * 8).save_pretrained(path)
    ours = get_image_processor(path, AutoConfig.from_pretrained(path))
    assert ours.max_pixels == QWEN_MAX_PIXELS
    assert_same_qwen(ours, hf_processor(tmp_path), images["astronaut"])


def test_to_rgb_matches_hf(images):
    from transformers.image_transforms import convert_to_rgb

    if not hf_composites_alpha():
        pytest.skip("this transformers predates compositing transparency onto white")

    for name, image in images.items():
        ours = to_rgb(image)
        assert ours.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(ours), convert_to_rgb(image, return_numpy=True))
    # Transparent pixels become white, opaque ones keep their colour.
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 255))
    assert np.asarray(to_rgb(rgba)).tolist() == [[[255, 255, 255], [10, 20, 30]]]


def _exif_jpeg(orientation: int) -> tuple[bytes, Image.Image]:
    """A 60x30 JPEG whose EXIF says: rotate ``orientation``; and the stored image."""
    gradient = np.linspace(0, 255, 60 * 30 * 3).reshape(30, 60, 3).astype(np.uint8)
    stored = Image.fromarray(gradient)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif, quality=95)
    return buffer.getvalue(), stored


def test_exif_orientation_is_applied(qwen_dir, tmp_path):
    data, _ = _exif_jpeg(6)
    image = load_image(data)
    assert image.size == (30, 60)  # orientation 6: rotate 90° clockwise to display
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    np.testing.assert_array_equal(np.asarray(image), np.asarray(reference))
    ours = get_image_processor(str(qwen_dir), SimpleNamespace(model_type="qwen2_vl"))
    assert_same_qwen(ours, hf_processor(qwen_dir), image)
    path = tmp_path / "rotated.jpg"
    path.write_bytes(data)
    for source in (path, str(path), Image.open(io.BytesIO(data))):
        assert load_image(source).size == (30, 60)
    assert load_image(_exif_jpeg(1)[0]).size == (60, 30)


def test_bad_inputs_raise_value_error(qwen_dir, clip_dir, tmp_path):
    good = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(good, format="PNG")
    cases = {
        "empty": b"",
        "garbage": b"definitely not an image",
        "truncated": good.getvalue()[:40],
        "zero width": Image.new("RGB", (0, 5)),
        "missing file": tmp_path / "missing.png",
        "wrong type": 12345,
    }
    for name, source in cases.items():
        with pytest.raises(ValueError):
            load_image(source)
            pytest.fail(f"{name} was accepted")
    qwen = get_image_processor(str(qwen_dir), SimpleNamespace(model_type="qwen2_vl"))
    clip = get_image_processor(str(clip_dir), llava_config())
    for processor in (qwen, clip):
        with pytest.raises(ValueError, match="no pixels"):
            processor.preprocess(Image.new("RGB", (0, 0)))
    with pytest.raises(ValueError, match="aspect ratio"):
        qwen.preprocess(Image.new("RGB", (500, 2)))


def test_get_image_processor_dispatch(qwen_dir, tmp_path):
    from transformers import Qwen2VLConfig

    assert isinstance(get_image_processor(str(qwen_dir), Qwen2VLConfig()), Qwen2VLImageProcessor)
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl, llava"):
        get_image_processor(str(qwen_dir), SimpleNamespace(model_type="llama"))
    with pytest.raises(FileNotFoundError, match="processor_config.json.*preprocessor_config"):
        get_image_processor(str(tmp_path), SimpleNamespace(model_type="qwen2_vl"))
    (tmp_path / "processor_config.json").write_text('{"image_processor": [1, 2]}')
    with pytest.raises(ValueError, match="'image_processor' must be an object"):
        get_image_processor(str(tmp_path), SimpleNamespace(model_type="qwen2_vl"))
