"""Photographs that ship offline, and random square crops of them for image models.

The photographs are the ones bundled inside the scikit-learn and
scikit-image wheels (no download): scikit-learn's ``china.jpg`` and
``flower.jpg``, and scikit-image's astronaut, cat (``chelsea``), coffee,
rocket, motorcycle, cameraman, retina, immunohistochemistry and Hubble deep
field images. Grayscale ones are repeated over three channels.

Crops are squares of 35-100% of the photograph's shorter side at a random
place, flipped left-right half of the time, resized to the model's size with
Pillow's bilinear filter (antialiased when shrinking). Two calls with
different seeds give different crops; a sample calibrates on one seed and
evaluates on another.

Example:
  >>> images = crops(load_photographs(), count=8, seed=0)
  >>> images.shape, images.dtype
  ((8, 224, 224, 3), dtype('uint8'))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["SCIKIT_IMAGE_FILES", "crops", "load_photographs"]

SCIKIT_IMAGE_FILES = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
                      "camera.png", "retina.jpg", "ihc.png", "hubble_deep_field.jpg")


def load_photographs() -> dict[str, np.ndarray]:
    """Name -> RGB uint8 image (H, W, 3) for each bundled photograph (11 of them)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    try:
        import skimage
    except ImportError:
        raise ImportError("The photographs need scikit-image's bundled data: python -m pip install "
                          "scikit-image==0.26.0") from None
    bunch = load_sample_images()
    photos = {Path(name).name: np.asarray(image) for name, image in zip(bunch.filenames, bunch.images)}
    directory = Path(skimage.__file__).parent / "data"
    for name in SCIKIT_IMAGE_FILES:
        image = np.asarray(Image.open(directory / name))
        if image.ndim == 2:
            image = np.repeat(image[..., None], 3, axis=-1)
        photos[name] = np.ascontiguousarray(image[..., :3]).astype(np.uint8)
    return photos


def crops(photos: dict[str, np.ndarray], count: int, seed: int, size: int = 224) -> np.ndarray:
    """`count` random square crops (uint8, (count, size, size, 3)), cycling over the photographs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = list(photos.values())
    out = np.empty((count, size, size, 3), np.uint8)
    for index in range(count):
        image = images[index % len(images)]
        height, width = image.shape[:2]
        side = int(min(height, width) * rng.uniform(0.35, 1.0))
        top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
        crop = image[top:top + side, left:left + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        out[index] = np.asarray(Image.fromarray(np.ascontiguousarray(crop)).resize(
            (size, size), Image.BILINEAR))
    return out
