"""The fuzzer's model classes (`tests.fuzz.generator` draws their block lists):
Linen CNN, sequence model and MLP from tuples of blocks (so the modules stay
hashable), an NNX CNN with BatchNorm and Dropout, and an NNX sequence model
with transformer blocks as Python layers or stacked by nnx.vmap and applied
by nnx.scan."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS: dict[str, Callable] = {
    "relu": nn.relu, "relu6": nn.relu6, "gelu": nn.gelu, "tanh": jnp.tanh, "sigmoid": nn.sigmoid,
    "hard_swish": nn.hard_swish, "leaky_relu": nn.leaky_relu, "silu": nn.silu, "hard_tanh": nn.hard_tanh,
}


# ---------------------------------------------------------------------------
# Linen models from block lists (tuples, so the modules stay hashable)


class FuzzCnn(nn.Module):
    blocks: tuple
    classes: int = 5

    @nn.compact
    def __call__(self, x):
        for block in self.blocks:
            kind = block[0]
            if kind == "conv":
                _, features, k, stride, dilation, groups = block
                x = nn.Conv(features, (k, k), strides=stride, kernel_dilation=dilation,
                            feature_group_count=groups, padding="SAME")(x)
            elif kind == "bn":
                x = nn.BatchNorm(use_running_average=True)(x)
            elif kind == "act":
                x = ACTIVATIONS[block[1]](x)
            elif kind == "res":
                y = nn.relu(nn.Conv(x.shape[-1], (3, 3), padding="SAME")(x))
                x = x + nn.Conv(x.shape[-1], (1, 1))(y)
            elif kind == "concat":
                x = jnp.concatenate([x, nn.Conv(block[1], (1, 1))(x)], axis=-1)
            elif kind == "maxpool":
                x = nn.max_pool(x, (block[1], block[1]), strides=(block[2], block[2]), padding=block[3])
            elif kind == "avgpool":
                x = nn.avg_pool(x, (block[1], block[1]), strides=(block[2], block[2]))
            elif kind == "avgpool_same":
                x = nn.avg_pool(x, (block[1], block[1]), padding="SAME")
            elif kind == "resize":
                b, h, w, c = x.shape
                x = jax.image.resize(x, (b, 2 * h, 2 * w, c), block[1])
            elif kind == "conv_transpose":
                x = nn.ConvTranspose(block[1], (block[2], block[2]), strides=(2, 2))(x)
            elif kind == "scale":
                x = x * block[1] + block[2]
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes)(x)


class _StackedBlock(nn.Module):
    """A pre-norm transformer block, one layer of an `nn.scan` stack."""

    heads: int

    @nn.compact
    def __call__(self, x, _):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, deterministic=True)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(nn.RMSNorm()(x)))), None


class FuzzSeq(nn.Module):
    blocks: tuple
    width: int
    classes: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for block in self.blocks:
            kind = block[0]
            if kind == "dense":
                x = nn.Dense(self.width)(x)
            elif kind == "act":
                x = ACTIVATIONS[block[1]](x)
            elif kind == "ln":
                x = nn.LayerNorm()(x)
            elif kind == "rms":
                x = nn.RMSNorm()(x)
            elif kind == "attn":
                _, heads, causal = block
                mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if causal else None
                x = x + nn.MultiHeadDotProductAttention(num_heads=heads, deterministic=True)(x, x, mask=mask)
            elif kind == "mlp":
                x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))
            elif kind == "softmax":
                x = jax.nn.softmax(x, axis=-1) * self.width
            elif kind == "conv1d":  # over the sequence, then a 1-D pool that keeps its length
                _, k, pool = block
                x = nn.relu(nn.Conv(self.width, (k,))(x))
                if pool == "max":
                    x = nn.max_pool(x, (3,), strides=(1,), padding="SAME")
                elif pool == "avg":
                    x = nn.avg_pool(x, (3,), strides=(1,), padding="SAME")
            elif kind == "flip_concat":  # a backward branch beside a forward one (nn.Bidirectional)
                h = nn.Dense(self.width)(x)
                x = nn.Dense(self.width)(jnp.concatenate([jnp.flip(h, 1), nn.relu(h)], -1))
            elif kind == "twice":  # one value computed twice (the converter keeps one tensor)
                x = nn.Dense(self.width)(ACTIVATIONS[block[1]](x)) + nn.Dense(self.width)(ACTIVATIONS[block[1]](x))
            elif kind == "scan":  # layers stacked by nn.scan, the residual stream as the loop's carry
                x, _ = nn.scan(_StackedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                               length=block[1])(heads=block[2])(x, None)
        return nn.Dense(self.classes)(jnp.mean(x, axis=1))


class FuzzMlp(nn.Module):
    blocks: tuple

    @nn.compact
    def __call__(self, x):
        for block in self.blocks:
            if block[0] == "dense":
                x = nn.Dense(block[1])(x)
            elif block[0] == "act":
                x = ACTIVATIONS[block[1]](x)
            elif block[0] == "res":
                x = x + nn.Dense(x.shape[-1])(nn.relu(x))
            elif block[0] == "ln":
                x = nn.LayerNorm()(x)
        return nn.Dense(3)(x)


class FuzzNnxCnn(nnx.Module):
    def __init__(self, channels: tuple[int, ...], act: str, *, rngs: nnx.Rngs):
        convs, norms = [], []
        c_in = 3
        for c in channels:
            convs.append(nnx.Conv(c_in, c, (3, 3), rngs=rngs))
            norms.append(nnx.BatchNorm(c, use_running_average=True, rngs=rngs))
            c_in = c
        self.convs, self.norms = nnx.List(convs), nnx.List(norms)
        self.dropout = nnx.Dropout(0.2, deterministic=True, rngs=rngs)
        self.head = nnx.Linear(c_in, 4, rngs=rngs)
        self.act = act

    def __call__(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = ACTIVATIONS[self.act](norm(conv(x)))
        return self.head(self.dropout(jnp.mean(x, axis=(1, 2))))


class _NnxBlock(nnx.Module):
    """A pre-norm transformer block in NNX: self-attention (nnx.MultiHeadAttention,
    causal or not) and a gated MLP written with nnx.Einsum."""

    def __init__(self, width: int, heads: int, causal: bool, rms: bool, *, rngs: nnx.Rngs):
        norm = nnx.RMSNorm if rms else nnx.LayerNorm
        self.norm1, self.norm2 = norm(width, rngs=rngs), norm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False,
                                                deterministic=True, rngs=rngs)
        self.gate_up = nnx.Einsum("btd,dkf->btkf", (width, 2, 2 * width), rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.causal = causal

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
        x = x + self.attention(self.norm1(x), mask=mask)
        h = self.gate_up(self.norm2(x))
        return x + self.down(nnx.silu(h[:, :, 0]) * h[:, :, 1])


def _stacked_blocks(width: int, layers: int, heads: int, causal: bool, *, rngs: nnx.Rngs) -> _NnxBlock:
    """`layers` blocks stacked by nnx.vmap (their parameters along a first axis), for nnx.scan."""
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(axis_size=layers)
    def create(rngs: nnx.Rngs):
        return _NnxBlock(width, heads, causal, False, rngs=rngs)

    return create(rngs)


class FuzzNnxSeq(nnx.Module):
    """An NNX sequence model: a projection, then blocks drawn from `_NNX_SEQ_TABLE`
    (NNX transformer blocks, as Python layers or stacked by nnx.vmap and applied
    by nnx.scan; nnx.Linear, nnx.Einsum, norms, activations, a 1-D nnx.Conv), a
    mean over positions and a head."""

    def __init__(self, blocks: tuple, width: int, features: int, *, rngs: nnx.Rngs):
        self.project = nnx.Linear(features, width, rngs=rngs)
        layers = []
        for block in blocks:
            kind = block[0]
            if kind == "block":
                layers.append(_NnxBlock(width, block[1], block[2], block[3], rngs=rngs))
            elif kind == "scan":
                layers.append(_stacked_blocks(width, *block[1:], rngs=rngs))
            elif kind == "linear":
                layers.append(nnx.Linear(width, width, rngs=rngs))
            elif kind == "einsum":
                layers.append(nnx.Einsum("btd,dh->bth", (width, width), (width,), rngs=rngs))
            elif kind == "ln":
                layers.append(nnx.LayerNorm(width, rngs=rngs))
            elif kind == "rms":
                layers.append(nnx.RMSNorm(width, rngs=rngs))
            elif kind == "conv1d":
                layers.append(nnx.Conv(width, width, (block[1],), rngs=rngs))
            else:
                layers.append(None)  # 'act': no parameters
        self.layers = nnx.List(layers)
        self.blocks = blocks
        self.head = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
        x = self.project(x)
        for block, layer in zip(self.blocks, self.layers):
            if block[0] == "scan":
                @nnx.scan
                def step(x, layer):
                    return layer(x), None

                x = step(x, layer)[0]
            elif block[0] == "act":
                x = ACTIVATIONS[block[1]](x)
            elif block[0] == "conv1d":
                x = nnx.relu(layer(x))
            else:
                x = layer(x)
        return self.head(jnp.mean(x, axis=1))
