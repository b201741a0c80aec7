"""A Gemma-style decoder in NNX, written the way Flax's examples/gemma writes
one: projections by ``nnx.Einsum`` (a query by ``'BTD,NDH->BTNH'``, keys and
values by one ``'BTD,CKDH->CBTKH'`` kernel, the output by ``'BTNH,NHD->BTD'``),
grouped-query attention through a 5-axis einsum, RMSNorms scaling by
``1 + scale`` (on queries and keys too, and after attention and the MLP),
rotary embeddings from positions divided by a vector of timescales, a
sliding-window layer and a global one, a gated GELU MLP initialized at
``normal(0.01)`` (the example's default), and the embedding table read back
as the output projection (``nnx.Embed.attend``).

The model takes token ids; it builds the positions (0..L-1) and the causal
mask itself, as a prefill export does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, WINDOW = 256, 64, 4, 2, 16, 128, 6
_MASKED = -2.3819763e38  # what the example writes into masked logits


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.scale = nnx.Param(0.1 * jax.random.normal(rngs.params(), (dim,)))

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return x * (1.0 + self.scale[...])


def rotary(x, positions, base: float = 10_000.0):
    timescale = base ** (2 * jnp.arange(0, HEAD_DIM // 2) / HEAD_DIM)
    angles = (positions[..., None] / timescale)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * jnp.cos(angles) - second * jnp.sin(angles),
                            second * jnp.cos(angles) + first * jnp.sin(angles)], axis=-1)


class Attention(nnx.Module):
    def __init__(self, window: int | None, rngs: nnx.Rngs):
        self.q = nnx.Einsum("BTD,NDH->BTNH", (HEADS, DIM, HEAD_DIM), rngs=rngs)
        self.kv = nnx.Einsum("BTD,CKDH->CBTKH", (2, KV_HEADS, DIM, HEAD_DIM), rngs=rngs)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, DIM), rngs=rngs)
        self.q_norm, self.k_norm = RMSNorm(HEAD_DIM, rngs), RMSNorm(HEAD_DIM, rngs)
        self.window = window

    def __call__(self, x, positions, mask):
        q = rotary(self.q_norm(self.q(x)), positions) * HEAD_DIM ** -0.5
        k, v = self.kv(x)
        k = rotary(self.k_norm(k), positions)
        b, t = x.shape[:2]
        groups = HEADS // KV_HEADS
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, KV_HEADS, groups, HEAD_DIM), k)
        logits = logits.reshape(b, t, HEADS, t)
        if self.window is not None:
            ones = jnp.ones(mask.shape, mask.dtype)
            mask = mask * jnp.triu(ones, 1 - self.window) * jnp.tril(ones, self.window - 1)
        probs = jax.nn.softmax(jnp.where(jnp.expand_dims(mask, -2), logits, _MASKED), axis=-1)
        context = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, KV_HEADS, groups, t), v)
        return self.out(context.reshape(b, t, HEADS, HEAD_DIM))


class Block(nnx.Module):
    def __init__(self, window: int | None, rngs: nnx.Rngs):
        self.pre_attention, self.post_attention = RMSNorm(DIM, rngs), RMSNorm(DIM, rngs)
        self.pre_mlp, self.post_mlp = RMSNorm(DIM, rngs), RMSNorm(DIM, rngs)
        self.attention = Attention(window, rngs)
        init = nnx.initializers.normal()
        self.gate = nnx.Linear(DIM, HIDDEN, use_bias=False, kernel_init=init, rngs=rngs)
        self.up = nnx.Linear(DIM, HIDDEN, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DIM, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.post_attention(self.attention(self.pre_attention(x), positions, mask))
        h = self.pre_mlp(x)
        return x + self.post_mlp(self.down(jax.nn.gelu(self.gate(h)) * self.up(h)))


class GemmaLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(WINDOW, rngs), Block(None, rngs)])
        self.final_norm = RMSNorm(DIM, rngs)

    def __call__(self, tokens):
        t = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
        x = self.embed(tokens) * np.float32(np.sqrt(DIM))
        for block in self.blocks:
            x = block(x, positions, mask)
        return self.embed.attend(self.final_norm(x))


def gemma_nnx():
    from tests.zoo.models import SEED, ZooModel, _token_batches, _token_example

    model = GemmaLM(nnx.Rngs(SEED))
    seq = 16
    example = _token_example(seq, VOCAB, with_mask=False)
    return ZooModel("gemma_nnx", model, None, example, _token_batches(seq, VOCAB, with_mask=False), "transformer")
