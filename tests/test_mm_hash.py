"""The image content hash: what changes it, what does not, and that it agrees across processes."""

from __future__ import annotations

import io
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mm_serve.cache import MultiModalHasher
from mm_serve.encoders.qwen2_vl_processor import Qwen2VLImageProcessor

MODEL = "Qwen/Qwen2-VL-2B-Instruct"


def photo(name: str) -> Image.Image:
    """A real photograph shipped with scikit-image."""
    import skimage

    return Image.open(Path(skimage.__file__).parent / "data" / name)


def jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def hasher() -> MultiModalHasher:
    return MultiModalHasher(MODEL, Qwen2VLImageProcessor().hash_kwargs())


@pytest.fixture(scope="module")
def chelsea_jpeg() -> bytes:
    return jpeg(photo("chelsea.png"), quality=90)


def test_digest_is_xxh3_128_hex_and_deterministic(hasher, chelsea_jpeg):
    digest = hasher.hash_image(chelsea_jpeg)
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert hasher.hash_image(bytearray(chelsea_jpeg)) == digest
    assert hasher.hash_image(memoryview(chelsea_jpeg)) == digest


def test_reencoded_picture_hashes_differently(hasher, chelsea_jpeg):
    other_quality = jpeg(photo("chelsea.png"), quality=70)
    assert Image.open(io.BytesIO(other_quality)).size == Image.open(io.BytesIO(chelsea_jpeg)).size
    assert hasher.hash_image(other_quality) != hasher.hash_image(chelsea_jpeg)


def test_processor_settings_and_model_enter_the_hash(hasher, chelsea_jpeg):
    small = Qwen2VLImageProcessor(max_pixels=256 * 28 * 28)
    assert small.hash_kwargs() != Qwen2VLImageProcessor().hash_kwargs()
    resized = MultiModalHasher(MODEL, small.hash_kwargs(), seed=hasher.seed)
    assert resized.hash_image(chelsea_jpeg) != hasher.hash_image(chelsea_jpeg)
    kwargs = dict(hasher.processor_kwargs)
    other_model = MultiModalHasher("Qwen/Qwen2-VL-7B-Instruct", kwargs, seed=hasher.seed)
    assert other_model.hash_image(chelsea_jpeg) != hasher.hash_image(chelsea_jpeg)
    same = MultiModalHasher(MODEL, Qwen2VLImageProcessor().hash_kwargs(), seed=hasher.seed)
    assert same.hash_image(chelsea_jpeg) == hasher.hash_image(chelsea_jpeg)


def test_uuid_stands_in_for_the_content(hasher, chelsea_jpeg):
    other = jpeg(photo("coffee.png"), quality=90)
    assert hasher.hash_image(chelsea_jpeg, uuid="cat") == hasher.hash_image(other, uuid="cat")
    assert hasher.hash_image(chelsea_jpeg, uuid="cat") != hasher.hash_image(chelsea_jpeg, "dog")
    assert hasher.hash_image(chelsea_jpeg, uuid="cat") != hasher.hash_image(chelsea_jpeg)
    # Tagged by kind: a uuid never collides with bytes spelling the same text.
    assert hasher.hash_image(b"cat") != hasher.hash_image(b"whatever", uuid="cat")


def test_path_hashes_as_its_bytes(hasher, chelsea_jpeg, tmp_path):
    path = tmp_path / "chelsea.jpg"
    path.write_bytes(chelsea_jpeg)
    assert hasher.hash_image(str(path)) == hasher.hash_image(chelsea_jpeg)
    assert hasher.hash_image(path) == hasher.hash_image(chelsea_jpeg)
    with pytest.raises(ValueError, match="not found"):
        hasher.hash_image(str(tmp_path / "missing.jpg"))


def test_pil_image_hashes_by_pixels(hasher):
    image = photo("astronaut.png")
    copy = Image.fromarray(np.array(image))
    assert hasher.hash_image(copy) == hasher.hash_image(image)
    pixels = np.array(image)
    pixels[0, 0, 0] ^= 1
    assert hasher.hash_image(Image.fromarray(pixels)) != hasher.hash_image(image)
    assert hasher.hash_image(image.convert("L")) != hasher.hash_image(image)
    # Same palette indices, other colours: other pixels once converted to RGB.
    indices = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), mode="P")
    recoloured = indices.copy()
    indices.putpalette(list(range(256)) * 3)
    recoloured.putpalette(list(reversed(range(256))) * 3)
    assert hasher.hash_image(indices) != hasher.hash_image(recoloured)
    assert hasher.hash_image(image) != hasher.hash_image(image, uuid="astronaut")


def test_unsupported_and_truncated_inputs_raise_value_error(hasher, chelsea_jpeg):
    with pytest.raises(ValueError, match="Cannot load an image from a object"):
        hasher.hash_image(object())
    truncated = Image.open(io.BytesIO(chelsea_jpeg[: len(chelsea_jpeg) // 2]))
    with pytest.raises(ValueError, match="Cannot read the image's pixels"):
        hasher.hash_image(truncated)


def test_same_hasher_agrees_across_processes_and_seeds_differ(hasher, chelsea_jpeg):
    assert pickle.loads(pickle.dumps(hasher)).seed == hasher.seed
    # A fresh interpreter: nothing shared with this process but the pickled hasher.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        remote = pool.submit(hasher.hash_image, chelsea_jpeg).result()
        remote_uuid = pool.submit(hasher.hash_image, chelsea_jpeg, "cat").result()
    assert remote == hasher.hash_image(chelsea_jpeg)
    assert remote_uuid == hasher.hash_image(chelsea_jpeg, uuid="cat")
    reseeded = MultiModalHasher(MODEL, dict(hasher.processor_kwargs), seed=hasher.seed + 1)
    assert reseeded.hash_image(chelsea_jpeg) != remote
    assert MultiModalHasher(MODEL, {}).seed != MultiModalHasher(MODEL, {}).seed
