"""A small Gemma/Llama-style decoder in Flax Linen, with a KV cache: prefill and one-token decode.

The blocks are those of today's small on-device language models: RMSNorm
before attention and before the MLP, rotary position embeddings (the
rotate-half form), grouped-query attention (`kv_heads` key/value heads
shared by `heads // kv_heads` query heads each), a gated MLP
(``down(silu(gate(x)) * up(x))``), no biases, and an output projection tied
to the token embedding (``logits = h @ embedding.T``).

The KV cache is the model's state, passed in and returned (a pure function,
so one traced program serves JAX, XLA serving and the LiteRT export, whose
signatures take the cache as tensors): a key and a value tensor per layer,
``(batch, kv_heads, cache_length, head_dim)`` each, in the layout attention
reads (its two batched matmuls take them as they are: no transpose, and no
stacking of layers that would copy the whole cache every step), ordered
``keys_0, values_0, keys_1, ...`` (`Decoder.empty_cache`, `cache_names`). Three
methods of the one module read the same weights:

- ``__call__(tokens)``: logits of every position of ``(batch, length)``
  tokens (causal; training and perplexity; no cache);
- ``prefill(tokens, *cache)``: ``(logits, *cache)``, the same logits for a
  prompt at positions ``0 .. length-1``, its keys and values written there
  (the rest of the cache kept);
- ``decode(token, position, *cache)``: ``(logits, *cache)`` for one token
  ``(batch, 1)`` at ``position`` ``(batch,)`` int32 (each row its own),
  attending to the cache up to and including it, its key and value written
  there (a select against the position, elementwise: no dynamic slice for a
  converter to place; measured as fast as a dynamic update in this layout).

A masked attention score gets float32's lowest value added (``scores +
where(visible, 0, finfo.min)``), as transformers masks: a masked key's weight
is exactly zero whatever the scores. (An additive bias
such as -30 is not a mask while training: the model learns scores above 30
and reads the bytes it is asked to predict. A quantized score edge
calibrates around the sentinel: `odmlq.Masked`.)
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DecoderConfig", "Decoder", "rotary"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder's sizes (defaults: the ~3.2M-parameter byte-level model of `samples.decoder_lm`)."""

    vocab_size: int = 256
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp_hidden: int = 768
    cache_length: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden",
                     "cache_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{name}={value!r}; give a positive integer.")
        if self.heads % self.kv_heads:
            raise ValueError(f"DecoderConfig: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                             "each key/value head serves the same number of query heads.")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim={self.head_dim}: rotary embeddings rotate pairs of "
                             "features; give an even head_dim.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rotary(x: jax.Array, positions: jax.Array, base: float, table_length: int) -> jax.Array:
    """Rotary position embedding of ``x`` ``(batch, length, heads, head_dim)`` at
    ``positions`` ``(batch, length)``: feature ``i`` and ``i + head_dim/2`` turn
    by ``position * base**(-2i/head_dim)``. The cosines and sines are a constant
    table of `table_length` positions (computed in float64), gathered by
    position: no integer-to-float cast of the positions in the program."""
    half = x.shape[-1] // 2
    angles = np.arange(table_length)[:, None] * base ** (-np.arange(half) / half)
    cos = jnp.take(jnp.asarray(np.cos(angles), jnp.float32), positions, axis=0, mode="clip")[:, :, None, :]
    sin = jnp.take(jnp.asarray(np.sin(angles), jnp.float32), positions, axis=0, mode="clip")[:, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class ClippedEmbed(nn.Embed):
    """nn.Embed whose lookup clamps ids into the table: one GATHER in the .tflite
    (nn.Embed's fill mode adds a bounds check of integer ops around it)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, inputs, axis=0, mode="clip")


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * scale


class Attention(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x, positions, keys, values):
        c = self.config
        batch, length = x.shape[:2]

        def projected(heads, name):  # one 2-D kernel, (hidden, heads * head_dim): one scale per output channel
            return nn.Dense(heads * c.head_dim, use_bias=False, name=name)(x).reshape(batch, length, heads, c.head_dim)

        table = max(c.cache_length, length)
        groups = c.heads // c.kv_heads
        # Heads first, as the cache holds them: (batch, heads, length, head_dim).
        q = rotary(projected(c.heads, "query"), positions, c.rope_base, table).transpose(0, 2, 1, 3)
        k = rotary(projected(c.kv_heads, "key"), positions, c.rope_base, table).transpose(0, 2, 1, 3)
        v = projected(c.kv_heads, "value").transpose(0, 2, 1, 3)
        if keys is None:  # the whole sequence, no cache
            keys, values, key_positions = k, v, positions
        else:
            keys, values = _written(keys, k, positions), _written(values, v, positions)
            key_positions = jnp.arange(keys.shape[2], dtype=jnp.int32)[None]
        # Each key/value head's query heads and positions as the rows of one matmul.
        q = q.reshape(batch, c.kv_heads, groups * length, c.head_dim)
        scores = jnp.einsum("bkqd,bksd->bkqs", q, keys) / np.float32(np.sqrt(c.head_dim))
        visible = key_positions[:, None, :] <= positions[:, :, None]  # (batch, length, keys)
        # Added, not selected: one ADD the delegate runs (a SELECT of the scores it does not), and
        # as exact: a score plus float32's lowest value is that value, whose softmax weight is 0.
        mask = jnp.where(visible, 0.0, jnp.finfo(scores.dtype).min).astype(scores.dtype)[:, None, None]
        scores = scores.reshape(batch, c.kv_heads, groups, length, -1) + mask
        weights = jax.nn.softmax(scores, axis=-1).reshape(batch, c.kv_heads, groups * length, -1)
        out = jnp.einsum("bkqs,bksd->bkqd", weights, values).reshape(batch, c.heads, length, c.head_dim)
        out = out.transpose(0, 2, 1, 3).reshape(batch, length, c.heads * c.head_dim)
        out = nn.Dense(c.hidden, use_bias=False, name="output")(out)
        return out, keys, values


class Block(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x, positions, keys, values):
        c = self.config
        attended, keys, values = Attention(c, name="attention")(
            RMSNorm(c.norm_eps, name="attention_norm")(x), positions, keys, values)
        x = x + attended
        h = RMSNorm(c.norm_eps, name="mlp_norm")(x)
        gate = nn.Dense(c.mlp_hidden, use_bias=False, name="gate")(h)
        up = nn.Dense(c.mlp_hidden, use_bias=False, name="up")(h)
        x = x + nn.Dense(c.hidden, use_bias=False, name="down")(nn.silu(gate) * up)
        return x, keys, values


class Decoder(nn.Module):
    """See the module doc. ``init`` with ``Decoder(config).init(key, tokens)``."""

    config: DecoderConfig = DecoderConfig()

    def setup(self):
        c = self.config
        # Unit-variance inputs after the sqrt(hidden) scale, logits of about unit variance at the start.
        self.embedding = ClippedEmbed(c.vocab_size, c.hidden, embedding_init=nn.initializers.normal(c.hidden ** -0.5),
                                  name="embedding")
        self.blocks = [Block(c, name=f"layer_{i}") for i in range(c.layers)]
        self.final_norm = RMSNorm(c.norm_eps, name="final_norm")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return _forward(self, tokens, positions, None)

    def prefill(self, tokens: jax.Array, *cache: jax.Array):
        """``(logits (batch, length, vocab), *cache)`` for a prompt at positions 0..length-1."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return _forward(self, tokens, positions, cache)

    def decode(self, token: jax.Array, position: jax.Array, *cache: jax.Array):
        """``(logits (batch, 1, vocab), *cache)`` for one token per row at `position` ``(batch,)``."""
        return _forward(self, token, jnp.asarray(position, jnp.int32).reshape(token.shape), cache)

    def empty_cache(self, batch: int = 1) -> tuple[np.ndarray, ...]:
        """Zero keys and values, ``(batch, kv_heads, cache_length, head_dim)`` float32 each,
        in the order of `cache_names`."""
        c = self.config
        return tuple(np.zeros((batch, c.kv_heads, c.cache_length, c.head_dim), np.float32)
                     for _ in range(2 * c.layers))

    def decode_state(self) -> dict[int, int]:
        """``{input index: output index}`` of `decode`'s cache: input ``2 + i``
        (after token and position) comes back as output ``1 + i`` (after the
        logits), as `odmlq.ptq` and `odmlq.plan` take ``state=``."""
        return {2 + i: 1 + i for i in range(2 * self.config.layers)}

    def cache_names(self) -> list[str]:
        """``keys_0, values_0, keys_1, values_1, ...``: the cache tensors' names, in order."""
        return [f"{kind}_{i}" for i in range(self.config.layers) for kind in ("keys", "values")]


def _written(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """`cache` ``(batch, heads, cache_length, head_dim)`` with `new` ``(batch, heads, length, ...)``
    written at `positions`: one token, at its row's position (a select); a prompt, at
    positions ``0 .. length-1`` (a concatenation)."""
    if new.shape[2] == 1:
        here = jnp.arange(cache.shape[2], dtype=jnp.int32)[None, :] == positions[:, :1]  # (batch, cache_length)
        return jnp.where(here[:, None, :, None], new.astype(cache.dtype), cache)
    return jnp.concatenate([new.astype(cache.dtype), cache[:, :, new.shape[2]:]], axis=2)


def _forward(decoder: Decoder, tokens, positions, cache):
    """The blocks, shared by the three methods (a function, not a method: Linen names the
    modules of a method it wraps after the method, and rules match the plain paths)."""
    c = decoder.config
    if cache is not None and len(cache) != 2 * c.layers:
        raise ValueError(f"The decoder has {c.layers} layers: give {2 * c.layers} cache tensors "
                         f"({', '.join(decoder.cache_names())}), as empty_cache returns; got {len(cache)}.")
    x = decoder.embedding(tokens) * np.float32(np.sqrt(c.hidden))
    written = []
    for i, block in enumerate(decoder.blocks):
        x, k, v = block(x, positions, *((None, None) if cache is None else cache[2 * i:2 * i + 2]))
        written += [k, v]
    logits = decoder.embedding.attend(decoder.final_norm(x))
    return logits if cache is None else (logits, *written)
