"""samples/photos.py: the bundled photographs and their crops."""

import numpy as np
import pytest

pytest.importorskip("skimage")

from samples.photos import crops, load_photographs  # noqa: E402


def test_eleven_rgb_photographs_ship_offline():
    photos = load_photographs()
    assert len(photos) == 11
    for name, image in photos.items():
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3, name
        assert min(image.shape[:2]) >= 256, name


def test_crops_are_reproducible_and_seeds_keep_calibration_apart_from_evaluation():
    photos = load_photographs()
    first, again, other = crops(photos, 12, seed=0), crops(photos, 12, seed=0), crops(photos, 12, seed=1)
    assert first.shape == (12, 224, 224, 3) and first.dtype == np.uint8
    np.testing.assert_array_equal(first, again)
    # No evaluation crop equals a calibration crop.
    assert not any(np.array_equal(a, b) for a in first for b in other)
