"""A zoo of models odmlq was not designed or tuned on.

Each entry of `ZOO` builds a small, randomly initialized model (fixed seed, no
download) and returns a `ZooModel`: the module, its variables (Linen) or None
(NNX: the module holds its state), batch-1 example inputs and a generator of
realistic input batches (images in [0, 1] or normalized as the model's
processor would, token ids in the vocabulary with padded attention masks).

- ``resnet18_linen``: ResNet-18 written as Flax's examples/imagenet does it
  (Conv without bias + BatchNorm + ReLU, residual blocks with 1x1 projections,
  7x7 stem and max pool, global mean, Dense head), 16 base filters, 32x32x3.
- ``cnn_nnx``: an NNX CNN with Conv, BatchNorm, Dropout and an ``nnx.Rngs``
  attribute (``self.rngs``), in eval mode.
- ``unet_linen``: a U-Net (tests/zoo/unet.py): BatchNorm convolutions, max
  pools, transposed convolutions up, skip concatenations, per-pixel logits.
- ``unet_resize_linen``: that U-Net with resize-convolutions up in place of
  its transposed convolutions (nearest ``jax.image.resize`` 2x, then a 3x3
  Conv, as diffusers' FlaxUpsample2D upsamples).
- ``mobilenet_v3_linen``: a MobileNetV3-Small-like CNN (tests/zoo/mobilenet.py):
  hard-swish, depthwise 3x3 and 5x5 convolutions, squeeze-excite gated by
  ``jax.nn.hard_sigmoid``, inference BatchNorm.
- ``transformer_lm_linen``: a decoder-only TransformerLM as Flax's
  examples/lm1b writes it (shift right, nn.Embed, sinusoidal positions, causal +
  padding mask, pre-LayerNorm MultiHeadDotProductAttention and ReLU MLP), every
  kernel and the embedding boxed by ``nn.with_logical_partitioning`` (the
  variables are kept boxed, as ``init`` returns them).
- ``gemma_nnx``: a Gemma-style NNX decoder as Flax's examples/gemma writes one (tests/zoo/gemma.py).
- ``hf_bert``, ``hf_vit``, ``hf_resnet``, ``hf_gpt2``, ``hf_llama``, ``hf_gpt_neo``: transformers' Flax
  models (4.x; transformers 5 has no Flax) from small configs. A
  ``FlaxPreTrainedModel`` is not a Linen module; its ``.module`` is, with
  ``.params`` its variables. Thin Linen wrappers take the model's public
  inputs, build what ``FlaxPreTrainedModel.__call__`` builds (position and
  token type ids; NCHW -> NHWC for images) and call the inner module with
  ``deterministic=True``. ``head_mask`` is left None (the pretrained model's
  ``__call__`` passes ones, which only multiplies attention weights by 1).

Every BatchNorm gets trained-looking statistics and affine parameters (mean
normal * U(0.1, 0.5), var U(0.5, 2), scale 1 + 0.2 * normal, bias 0.1 * normal)
instead of the identity init, so that folding BatchNorm is exercised.

transformers is imported only inside the ``hf_*`` factories.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SEED = 0


def _key(seed: int = SEED) -> jax.Array:
    """A PRNG key for initialization. XLA's RngBitGenerator ('rbg') rather than
    threefry: the same distributions, and jitted inits compile 3x faster."""
    return jax.random.key(seed, impl="rbg")


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo model, ready to run: ``model.apply(variables, *inputs)`` (Linen)
    or ``model(*inputs)`` (NNX, variables None)."""

    name: str
    model: Any
    variables: Any
    example_inputs: tuple[np.ndarray, ...]
    make_batches: Callable[[int, int, int], list[tuple[np.ndarray, ...]]]
    # 'cnn', 'mobile', 'transformer', 'audio', 'vae', 'diffusion', 'class_token', 'mean_pooled'
    family: str  # (floors: tests/zoo/test_zoo.py)

    def apply(self, *inputs):
        """The float model's output on `inputs`."""
        if self.variables is None:
            return self.model(*inputs)
        return self.model.apply(self.variables, *inputs)

    @property
    def num_params(self) -> int:
        if self.variables is None:
            state = nnx.state(self.model, nnx.Param)
        else:
            state = nn.unbox(self.variables).get("params", {})
        return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(state)))


# ---------------------------------------------------------------------------
# Inputs


def _images(rng: np.random.Generator, n: int, h: int, w: int, c: int) -> np.ndarray:
    """Image-like NHWC float32 in [0, 1]: smooth blobs (4x4 cells) plus fine noise."""
    coarse = rng.uniform(0.0, 1.0, (n, 4, 4, c))
    smooth = np.repeat(np.repeat(coarse, -(-h // 4), axis=1), -(-w // 4), axis=2)[:, :h, :w]
    return np.clip(smooth + 0.08 * rng.standard_normal((n, h, w, c)), 0.0, 1.0).astype(np.float32)


def _image_batches(h: int, w: int, c: int, *, nchw: bool = False, mean=None, std=None):
    def make(n_batches: int, batch_size: int, seed: int) -> list[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n_batches):
            x = _images(rng, batch_size, h, w, c)
            if mean is not None:
                x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
            if nchw:
                x = np.transpose(x, (0, 3, 1, 2))
            out.append((np.ascontiguousarray(x, np.float32),))
        return out
    return make


def _tokens(rng: np.random.Generator, n: int, seq: int, vocab: int, *, min_len: int,
            lengths: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded token ids in [1, vocab) (0 is padding) and their 0/1 mask."""
    if lengths is None:
        lengths = rng.integers(min_len, seq + 1, n)
    mask = (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = rng.integers(1, vocab, (n, seq)).astype(np.int32) * mask
    return ids.astype(np.int32), mask


def _token_batches(seq: int, vocab: int, *, with_mask: bool):
    def make(n_batches: int, batch_size: int, seed: int) -> list[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n_batches):
            ids, mask = _tokens(rng, batch_size, seq, vocab, min_len=seq // 2)
            out.append((ids, mask) if with_mask else (ids,))
        return out
    return make


def _token_example(seq: int, vocab: int, *, with_mask: bool) -> tuple[np.ndarray, ...]:
    """Batch 1, with 4 padding positions at the end."""
    ids, mask = _tokens(np.random.default_rng(SEED + 1), 1, seq, vocab, min_len=seq, lengths=[seq - 4])
    return (ids, mask) if with_mask else (ids,)


# ---------------------------------------------------------------------------
# Realistic BatchNorm values


def _bn_values(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "mean": (rng.standard_normal(n) * rng.uniform(0.1, 0.5, n)).astype(np.float32),
        "var": rng.uniform(0.5, 2.0, n).astype(np.float32),
        "scale": (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32),
        "bias": (0.1 * rng.standard_normal(n)).astype(np.float32),
    }


def randomize_batchnorm_linen(variables: Any, seed: int = SEED) -> dict:
    """Linen variables with every BatchNorm's running mean/var (``batch_stats``)
    and scale/bias (``params``, same module path) set to trained-looking values."""
    rng = np.random.default_rng(seed)
    variables = flax.core.unfreeze(variables)
    count = 0

    def walk(stats: dict, params: dict | None) -> None:
        nonlocal count
        if "mean" in stats and "var" in stats and not isinstance(stats["mean"], dict):
            values = _bn_values(rng, int(np.shape(stats["mean"])[-1]))
            stats["mean"] = jnp.asarray(values["mean"].reshape(np.shape(stats["mean"])))
            stats["var"] = jnp.asarray(values["var"].reshape(np.shape(stats["var"])))
            if params is not None:
                for key in ("scale", "bias"):
                    if key in params:
                        params[key] = jnp.asarray(values[key].reshape(np.shape(params[key])))
            count += 1
            return
        for key, child in stats.items():
            if isinstance(child, dict):
                walk(child, None if params is None else params.get(key))

    walk(variables.get("batch_stats", {}), variables.get("params"))
    if count == 0:
        raise ValueError("no BatchNorm statistics found in the variables")
    return variables


def randomize_batchnorm_nnx(model: nnx.Module, seed: int = SEED) -> int:
    """Sets every nnx.BatchNorm of `model` to trained-looking values; returns how many."""
    rng = np.random.default_rng(seed)
    count = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            values = _bn_values(rng, module.num_features)
            for key in ("mean", "var", "scale", "bias"):
                getattr(module, key)[...] = jnp.asarray(values[key])
            count += 1
    return count


# ---------------------------------------------------------------------------
# ResNet-18, Linen (as flax/examples/imagenet/models.py)

ModuleDef = Any


class ResNetBlock(nn.Module):
    """ResNet block."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """ResNetV1.5, as in Flax's ImageNet example. ``train`` defaults to False
    here (the example's default is True): odmlq calls ``__call__`` with the
    inputs alone, so inference must be the default."""

    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu
    conv: ModuleDef = nn.Conv

    @nn.compact
    def __call__(self, x, train: bool = False):
        conv = functools.partial(self.conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, dtype=self.dtype)
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm,
                                   act=self.act)(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNet18 = functools.partial(ResNet, stage_sizes=[2, 2, 2, 2], block_cls=ResNetBlock)


def resnet18_linen() -> ZooModel:
    model = ResNet18(num_classes=10, num_filters=16)
    make = _image_batches(32, 32, 3)
    example = make(1, 1, SEED + 1)[0]
    variables = jax.jit(functools.partial(model.init, train=False))(_key(), example[0])
    variables = randomize_batchnorm_linen(variables)
    return ZooModel("resnet18_linen", model, variables, example, make, "cnn")


# ---------------------------------------------------------------------------
# NNX CNN with BatchNorm, Dropout and an Rngs attribute


class NnxBnCNN(nnx.Module):
    def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, 16, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, rngs=rngs)
        self.conv3 = nnx.Conv(32, 64, (3, 3), strides=(2, 2), rngs=rngs)
        self.bn3 = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.25)
        self.linear1 = nnx.Linear(64, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, num_classes, rngs=rngs)
        self.rngs = rngs  # kept for the dropout masks at training time

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        x = nnx.relu(self.bn3(self.conv3(x)))
        x = jnp.mean(x, axis=(1, 2))
        x = self.dropout(x, rngs=self.rngs)
        x = nnx.relu(self.linear1(x))
        x = self.dropout(x, rngs=self.rngs)
        return self.linear2(x)


def cnn_nnx() -> ZooModel:
    model = nnx.jit(lambda: NnxBnCNN(rngs=nnx.Rngs(params=SEED, dropout=SEED + 1)))()
    if randomize_batchnorm_nnx(model) != 3:
        raise AssertionError("expected 3 BatchNorms")
    model.eval()
    make = _image_batches(32, 32, 3)
    return ZooModel("cnn_nnx", model, None, make(1, 1, SEED + 1)[0], make, "cnn")


# ---------------------------------------------------------------------------
# transformers' Flax models: tests/zoo/hf_models.py (it reads the helpers above).

from tests.zoo.hf_models import (hf_bert, hf_bloom, hf_distilbert, hf_gpt2, hf_gpt_neo, hf_gptj,  # noqa: E402
                                  hf_llama, hf_marian, hf_resnet, hf_vit, hf_wav2vec2)
from tests.zoo.hf_more import MORE  # noqa: E402
from tests.zoo.hf_composite import COMPOSITE  # noqa: E402
from tests.zoo.diffusion import controlnet_diffusers, unet_diffusers, vae_decoder_diffusers  # noqa: E402
from tests.zoo.gemma import gemma_nnx  # noqa: E402
from tests.zoo.lm1b import transformer_lm_linen  # noqa: E402
from tests.zoo.mobilenet import mobilenet_v3_linen  # noqa: E402
from tests.zoo.unet import unet_linen, unet_resize_linen  # noqa: E402


ZOO: dict[str, Callable[[], ZooModel]] = {
    "resnet18_linen": resnet18_linen,
    "cnn_nnx": cnn_nnx,
    "unet_linen": unet_linen,
    "unet_resize_linen": unet_resize_linen,
    "mobilenet_v3_linen": mobilenet_v3_linen,
    "transformer_lm_linen": transformer_lm_linen,
    "gemma_nnx": gemma_nnx,
    "hf_bert": hf_bert,
    "hf_vit": hf_vit,
    "hf_resnet": hf_resnet,
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "hf_gpt_neo": hf_gpt_neo,
    "hf_distilbert": hf_distilbert,
    "hf_bloom": hf_bloom,
    "hf_gptj": hf_gptj,
    "hf_marian": hf_marian,
    "hf_wav2vec2": hf_wav2vec2,
    "vae_decoder_diffusers": vae_decoder_diffusers,
    "unet_diffusers": unet_diffusers,
    "controlnet_diffusers": controlnet_diffusers,
    **MORE,
    **COMPOSITE,
}
# Models whose every zoo test runs with -m slow (the default run exports the first
# zoo; `tests.zoo.hf_more`'s forms are each tested alone where one needed a fix).
SLOW_ZOO = frozenset(MORE) | frozenset(COMPOSITE) | {"unet_diffusers", "controlnet_diffusers"}

NEEDS_TRANSFORMERS = frozenset(name for name in ZOO if name.startswith("hf_"))
NEEDS_DIFFUSERS = frozenset(name for name in ZOO if name.endswith("_diffusers"))
