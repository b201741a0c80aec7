"""A MobileNetV3-Small-like CNN for the zoo (Howard et al. 2019, at zoo size).

As MobileNetV3 is written in Flax: a strided 3x3 stem with hard-swish, inverted
residual blocks (1x1 expansion, depthwise 3x3 or 5x5, squeeze-excite gated by
``jax.nn.hard_sigmoid``, 1x1 projection; every convolution with inference
BatchNorm; ReLU in the early blocks, hard-swish in the later ones), a 1x1 conv
with hard-swish, global average pooling, a hard-swish Dense and the classifier.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def _bn(name):
    return nn.BatchNorm(use_running_average=True, name=name)


class SqueezeExcite(nn.Module):
    reduced: int

    @nn.compact
    def __call__(self, x):
        s = jnp.mean(x, axis=(1, 2), keepdims=True)
        s = nn.relu(nn.Conv(self.reduced, (1, 1), name="reduce")(s))
        return x * jax.nn.hard_sigmoid(nn.Conv(x.shape[-1], (1, 1), name="expand")(s))


class InvertedResidual(nn.Module):
    expanded: int
    out: int
    kernel: int
    stride: int
    se: bool
    hard_swish: bool

    @nn.compact
    def __call__(self, x):
        act = jax.nn.hard_swish if self.hard_swish else nn.relu
        h = x
        if self.expanded != x.shape[-1]:
            h = act(_bn("expand_bn")(nn.Conv(self.expanded, (1, 1), use_bias=False, name="expand")(h)))
        h = nn.Conv(self.expanded, (self.kernel, self.kernel), strides=self.stride, feature_group_count=self.expanded,
                    use_bias=False, name="depthwise")(h)
        h = act(_bn("depthwise_bn")(h))
        if self.se:
            h = SqueezeExcite(max(8, self.expanded // 4), name="se")(h)
        h = _bn("project_bn")(nn.Conv(self.out, (1, 1), use_bias=False, name="project")(h))
        return x + h if self.stride == 1 and x.shape[-1] == self.out else h


# (expanded, out, kernel, stride, squeeze-excite, hard-swish): MobileNetV3-Small's table, narrowed.
BLOCKS = ((16, 16, 3, 2, True, False), (48, 24, 3, 2, False, False), (64, 24, 3, 1, False, False),
          (96, 40, 5, 2, True, True), (160, 40, 5, 1, True, True), (120, 48, 5, 1, True, True),
          (192, 64, 5, 1, True, True))


class MobileNetV3(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = jax.nn.hard_swish(_bn("stem_bn")(nn.Conv(16, (3, 3), strides=2, use_bias=False, name="stem")(x)))
        for i, block in enumerate(BLOCKS):
            x = InvertedResidual(*block, name=f"block{i}")(x)
        x = jax.nn.hard_swish(_bn("head_bn")(nn.Conv(288, (1, 1), use_bias=False, name="head_conv")(x)))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, name="classifier")(jax.nn.hard_swish(nn.Dense(256, name="pre")(x)))


def mobilenet_v3_linen():
    from tests.zoo.unet import linen_cnn

    return linen_cnn("mobilenet_v3_linen", MobileNetV3(), "mobile")
