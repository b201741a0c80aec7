"""diffusers' Flax models for the zoo (diffusers 0.31: Flax models ship up to 0.35),
from small configs; diffusers is imported lazily, in each builder.

`vae_decoder_diffusers` is what a phone runs of a latent-diffusion pipeline: the
VAE decoder (FlaxAutoencoderKL.decode: GroupNorm + SiLU residual blocks, a
one-head self-attention over every latent position in its middle block,
nearest 2x upsampling and convolutions), latents (N, 4, 16, 16) in, images
(N, 3, 32, 32) out.

`unet_diffusers` is the denoiser a pipeline runs at every step
(FlaxUNet2DConditionModel: a sinusoidal embedding of each sample's integer
timestep, ResNet blocks it conditions, cross-attention to text embeddings,
skip connections), and `controlnet_diffusers` the ControlNet beside it (a
strided convolution stack over a conditioning image, the UNet's down and middle
blocks, one 1x1 convolution per residual it hands the UNet). The timestep's
SIN and COS have no integer kernel: they compute from an integer input and
constants only, and stay float (`allow_float_ops`, tests/zoo/test_zoo.py).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tests.zoo.models import SEED, ZooModel, _key


class VAEDecoder(nn.Module):
    """latents (NCHW, as diffusers takes them) -> the decoded sample (NCHW)."""

    inner: nn.Module

    def __call__(self, latents):
        return self.inner.decode(latents, deterministic=True).sample


def _latent_batches(n_batches: int, batch_size: int, seed: int) -> list[tuple[np.ndarray, ...]]:
    """Standard normal latents: what the diffusion process hands the decoder."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch_size, 4, 16, 16)).astype(np.float32),) for _ in range(n_batches)]


def vae_decoder_diffusers() -> ZooModel:
    from diffusers import FlaxAutoencoderKL

    vae = FlaxAutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
                            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                            block_out_channels=(32, 64), layers_per_block=1, sample_size=32)
    params = vae.init_weights(_key())
    # The encoder's weights are not the decoder's: only what decode reads is kept.
    params = {k: v for k, v in params.items() if k in ("decoder", "post_quant_conv")}
    return ZooModel("vae_decoder_diffusers", VAEDecoder(vae), {"params": {"inner": params}},
                    _latent_batches(1, 1, SEED + 1)[0], _latent_batches, "vae")


_UNET = dict(sample_size=16, in_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
             block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=4)


def _denoiser_batches(n_batches: int, batch_size: int, seed: int, *, cond: bool = False):
    """Noisy latents (N, 4, 16, 16), integer timesteps in [0, 1000), text embeddings
    (N, 8, 32) and, for ControlNet, a conditioning image in [0, 1] (N, 3, 128, 128)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        batch = (rng.standard_normal((batch_size, 4, 16, 16)).astype(np.float32),
                 rng.integers(0, 1000, (batch_size,)).astype(np.int32),
                 rng.standard_normal((batch_size, 8, 32)).astype(np.float32))
        if cond:
            edges = (rng.uniform(0, 1, (batch_size, 3, 16, 16)) > 0.7).astype(np.float32)
            batch += (np.repeat(np.repeat(edges, 8, axis=2), 8, axis=3),)
        out.append(batch)
    return out


class UNetDenoiser(nn.Module):
    """(latents NCHW, timesteps (N,) int32, text embeddings) -> the predicted noise (NCHW)."""

    inner: nn.Module

    def __call__(self, sample, timesteps, text):
        return self.inner(sample, jnp.asarray(timesteps), text, train=False).sample


def unet_diffusers() -> ZooModel:
    from diffusers import FlaxUNet2DConditionModel

    unet = FlaxUNet2DConditionModel(out_channels=4, up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), **_UNET)
    params = unet.init_weights(_key())
    return ZooModel("unet_diffusers", UNetDenoiser(unet), {"params": {"inner": params}},
                    _denoiser_batches(1, 1, SEED + 1)[0], _denoiser_batches, "diffusion")


class ControlNetResiduals(nn.Module):
    """(latents, timesteps, text embeddings, conditioning image NCHW) -> every residual
    ControlNet hands the UNet, flattened and side by side (N, features)."""

    inner: nn.Module

    def __call__(self, sample, timesteps, text, cond):
        down, mid = self.inner(sample, jnp.asarray(timesteps), text, cond, return_dict=False)
        return jnp.concatenate([r.reshape(r.shape[0], -1) for r in (*down, mid)], axis=-1)


def controlnet_diffusers() -> ZooModel:
    """ControlNet's output convolutions and its conditioning stack's last one initialize to
    zeros (training starts from the UNet's behaviour); they are drawn here, as a trained
    ControlNet has them."""
    from diffusers import FlaxControlNetModel

    controlnet = FlaxControlNetModel(conditioning_embedding_out_channels=(8, 8, 16, 16), **_UNET)
    params = jax.tree_util.tree_map(np.asarray, controlnet.init_weights(_key()))
    rng = np.random.default_rng(SEED)
    zeros = [block for name, block in params.items()
             if name.startswith("controlnet_down_blocks") or name == "controlnet_mid_block"]
    for block in [*zeros, params["controlnet_cond_embedding"]["conv_out"]]:
        block["kernel"] = (rng.standard_normal(block["kernel"].shape) * 0.2).astype(np.float32)
        block["bias"] = (rng.standard_normal(block["bias"].shape) * 0.05).astype(np.float32)
    make = functools.partial(_denoiser_batches, cond=True)
    return ZooModel("controlnet_diffusers", ControlNetResiduals(controlnet), {"params": {"inner": params}},
                    make(1, 1, SEED + 1)[0], make, "diffusion")
