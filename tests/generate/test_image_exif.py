"""Images are read upright, as the camera's EXIF Orientation tag says (issue 31): a phone
photo (JPEG, Orientation=6) was fed sideways, so tiles, prompt ids and tokens differed from
transformers' ``load_image``, which the model cards use."""
from __future__ import annotations

import numpy as np
import pytest


def _photo(path, orientation: int):
    from PIL import Image

    rng = np.random.RandomState(0)
    pixels = (rng.rand(24, 40, 3) * 255).astype(np.uint8)  # not square: a rotation changes the size
    image = Image.fromarray(pixels)
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    image.save(path, exif=exif.tobytes())
    return path


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
@pytest.mark.parametrize("orientation", [6, 3, 8])
def test_read_image_applies_exif_orientation_as_transformers(tmp_path, suffix, orientation):
    from transformers.image_utils import load_image

    from circleops.generation import vision

    path = _photo(tmp_path / f"photo{suffix}", orientation)
    ours, theirs = np.asarray(vision.read_image(path)), np.asarray(load_image(str(path)))
    assert ours.shape == theirs.shape == ((24, 40, 3) if orientation == 3 else (40, 24, 3))
    assert np.array_equal(ours, theirs)
