"""A U-Net (dense prediction: segmentation, denoising) for the zoo.

As U-Nets are commonly written in Flax (Ronneberger et al. 2015, at zoo
size): two 3x3 Conv + BatchNorm + ReLU per level, max pool down, transposed
convolutions up (a 2x2 kernel at stride 2 with its own bias, and a 3x3 one
with Flax's 'SAME' padding followed by BatchNorm), the encoder's features
concatenated at each level, and a 1x1 head giving per-pixel class logits.
`ResizeUNet` upsamples by nearest resize and convolution instead.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class DoubleConv(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.Conv(self.features, (3, 3), use_bias=False, name=f"conv{i}")(x)
            x = nn.relu(nn.BatchNorm(use_running_average=True, name=f"bn{i}")(x))
        return x


class UNet(nn.Module):
    classes: int = 4
    base: int = 8

    @nn.compact
    def __call__(self, x):
        d1 = DoubleConv(self.base, name="down1")(x)
        d2 = DoubleConv(2 * self.base, name="down2")(nn.max_pool(d1, (2, 2), strides=(2, 2)))
        b = DoubleConv(4 * self.base, name="bottom")(nn.max_pool(d2, (2, 2), strides=(2, 2)))
        u2 = nn.ConvTranspose(2 * self.base, (2, 2), strides=(2, 2), name="up2")(b)
        u2 = DoubleConv(2 * self.base, name="dec2")(jnp.concatenate([u2, d2], axis=-1))
        u1 = nn.ConvTranspose(self.base, (3, 3), strides=(2, 2), use_bias=False, name="up1")(u2)
        u1 = nn.relu(nn.BatchNorm(use_running_average=True, name="up1_bn")(u1))
        u1 = DoubleConv(self.base, name="dec1")(jnp.concatenate([u1, d1], axis=-1))
        return nn.Conv(self.classes, (1, 1), name="head")(u1)


def linen_cnn(name: str, model, family: str = "cnn"):
    """A zoo entry of a Linen CNN with BatchNorm on 32x32x3 images: initialized at the
    zoo's seed, its BatchNorm statistics randomized (`randomize_batchnorm_linen`)."""
    from tests.zoo.models import SEED, ZooModel, _image_batches, _key, randomize_batchnorm_linen

    make = _image_batches(32, 32, 3)
    example = make(1, 1, SEED + 1)[0]
    variables = randomize_batchnorm_linen(jax.jit(model.init)(_key(), example[0]))
    return ZooModel(name, model, variables, example, make, family)


def unet_linen():
    return linen_cnn("unet_linen", UNet())


class ResizeUNet(nn.Module):
    """The U-Net above with resize-convolution upsampling in place of its transposed
    convolutions: nearest ``jax.image.resize`` 2x, then a 3x3 Conv (diffusers'
    FlaxUpsample2D; segmentation U-Nets written to avoid a transposed convolution's
    checkerboard)."""

    classes: int = 4
    base: int = 8

    @nn.compact
    def __call__(self, x):
        def up(x, features, name):
            b, h, w, c = x.shape
            return nn.Conv(features, (3, 3), name=name)(jax.image.resize(x, (b, 2 * h, 2 * w, c), "nearest"))

        d1 = DoubleConv(self.base, name="down1")(x)
        d2 = DoubleConv(2 * self.base, name="down2")(nn.max_pool(d1, (2, 2), strides=(2, 2)))
        b = DoubleConv(4 * self.base, name="bottom")(nn.max_pool(d2, (2, 2), strides=(2, 2)))
        u2 = DoubleConv(2 * self.base, name="dec2")(jnp.concatenate([up(b, 2 * self.base, "up2"), d2], axis=-1))
        u1 = DoubleConv(self.base, name="dec1")(jnp.concatenate([up(u2, self.base, "up1"), d1], axis=-1))
        return nn.Conv(self.classes, (1, 1), name="head")(u1)


def unet_resize_linen():
    return linen_cnn("unet_resize_linen", ResizeUNet())
