"""EfficientNet-Lite0 in Flax Linen, for inference (BatchNorm from its running statistics).

Written from the architecture's published description (Tan & Le 2019, and
the Lite variants of the TensorFlow TPU repository): the EfficientNet-B0
stack of inverted-residual (MBConv) blocks with the changes made for integer
mobile inference — ReLU6 everywhere, no squeeze-and-excitation, and the stem
(32 channels) and head (1280 channels) kept at their B0 widths.

- Convolutions pad as TensorFlow's ``SAME`` does (the extra row and column of
  a stride-2 layer go at the bottom and right); the published weights were
  trained that way, and Flax's ``padding="SAME"`` is the same rule.
- BatchNorm uses epsilon 1e-3 (TensorFlow's EfficientNet default).
- The head is a global average pool, then a 1280 -> 1000 dense layer (dropout
  is a training-time op and has no place here).

Inputs are NHWC float32 images of 224 x 224, preprocessed by `preprocess`.

Example:
  >>> model = EfficientNetLite0()
  >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
  >>> model.apply(variables, jnp.zeros((1, 224, 224, 3))).shape
  (1, 1000)

References:
  Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
  Networks", ICML 2019. TensorFlow TPU models, ``efficientnet/lite``.
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

__all__ = ["BLOCKS", "BN_EPSILON", "IMAGE_SIZE", "MEAN", "STD", "BlockSpec", "EfficientNetLite0",
           "MBConv", "block_specs", "preprocess"]

IMAGE_SIZE = 224
BN_EPSILON = 1e-3
# The Lite checkpoints were trained on pixels scaled as (x - 127) / 128 (the
# TensorFlow Lite release's mean_rgb / stddev_rgb), x in 0..255.
MEAN = 127.0
STD = 128.0


@dataclass(frozen=True)
class BlockSpec:
    """One stage of MBConv blocks: kernel size, first stride, expansion, channels, repeats."""

    kernel: int
    stride: int
    expand: int
    channels_in: int
    channels_out: int
    repeats: int


# EfficientNet-B0's stages (depth and width multipliers 1.0 for Lite0).
BLOCKS = (
    BlockSpec(kernel=3, stride=1, expand=1, channels_in=32, channels_out=16, repeats=1),
    BlockSpec(kernel=3, stride=2, expand=6, channels_in=16, channels_out=24, repeats=2),
    BlockSpec(kernel=5, stride=2, expand=6, channels_in=24, channels_out=40, repeats=2),
    BlockSpec(kernel=3, stride=2, expand=6, channels_in=40, channels_out=80, repeats=3),
    BlockSpec(kernel=5, stride=1, expand=6, channels_in=80, channels_out=112, repeats=3),
    BlockSpec(kernel=5, stride=2, expand=6, channels_in=112, channels_out=192, repeats=4),
    BlockSpec(kernel=3, stride=1, expand=6, channels_in=192, channels_out=320, repeats=1),
)


def block_specs() -> list[BlockSpec]:
    """The 16 blocks one by one: the first of a stage strides, the rest keep shape."""
    blocks = []
    for stage in BLOCKS:
        blocks.append(BlockSpec(stage.kernel, stage.stride, stage.expand, stage.channels_in,
                                stage.channels_out, 1))
        blocks += [BlockSpec(stage.kernel, 1, stage.expand, stage.channels_out,
                             stage.channels_out, 1)] * (stage.repeats - 1)
    return blocks


def _batch_norm(name: str) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=True, epsilon=BN_EPSILON, momentum=0.99, name=name)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand, depthwise kxk, 1x1 project; a skip when shapes allow."""

    spec: BlockSpec

    @nn.compact
    def __call__(self, x):
        s = self.spec
        hidden = s.channels_in * s.expand
        y = x
        if s.expand != 1:
            y = nn.Conv(hidden, (1, 1), use_bias=False, name="expand_conv")(y)
            y = nn.relu6(_batch_norm("bn0")(y))
        y = nn.Conv(hidden, (s.kernel, s.kernel), strides=(s.stride, s.stride), padding="SAME",
                    feature_group_count=hidden, use_bias=False, name="depthwise_conv")(y)
        y = nn.relu6(_batch_norm("bn1")(y))
        y = nn.Conv(s.channels_out, (1, 1), use_bias=False, name="project_conv")(y)
        y = _batch_norm("bn2")(y)
        if s.stride == 1 and s.channels_in == s.channels_out:
            y = y + x
        return y


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0: images (N, 224, 224, 3), preprocessed, to 1000 ImageNet logits."""

    num_classes: int = 1000

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(32, (3, 3), strides=(2, 2), padding="SAME", use_bias=False, name="conv_stem")(x)
        x = nn.relu6(_batch_norm("bn0")(x))
        for index, spec in enumerate(block_specs()):
            x = MBConv(spec, name=f"blocks_{index}")(x)
        x = nn.Conv(1280, (1, 1), use_bias=False, name="conv_head")(x)
        x = nn.relu6(_batch_norm("bn1")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="fc")(x)


def preprocess(images: np.ndarray) -> np.ndarray:
    """uint8 (or 0..255 float) RGB images, already 224 x 224, to the model's float32 inputs."""
    return ((np.asarray(images, np.float32) - MEAN) / STD).astype(np.float32)
