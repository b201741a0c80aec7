"""diffusers' Flax models for the zoo (diffusers 0.31: Flax models ship up to 0.35),
from small configs; diffusers is imported lazily, in each builder.

`vae_decoder_diffusers` is what a phone runs of a latent-diffusion pipeline: the
VAE decoder (FlaxAutoencoderKL.decode: GroupNorm + SiLU residual blocks, a
one-head self-attention over every latent position in its middle block,
nearest 2x upsampling and convolutions), latents (N, 4, 16, 16) in, images
(N, 3, 32, 32) out.
"""

from __future__ import annotations

import flax.linen as nn
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
