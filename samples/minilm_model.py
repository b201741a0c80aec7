"""A BERT sentence encoder in Flax Linen, shaped like all-MiniLM-L6-v2.

`MiniLM` maps token ids and their mask to a sentence embedding, as
sentence-transformers' all-MiniLM-L6-v2 does: BERT embeddings (word +
position + token type, LayerNorm), `num_layers` post-LayerNorm transformer
layers, mean pooling over the real tokens, L2 normalization. Weights come from
the checkpoint through ``converters.minilm.load_minilm``.

Shapes are static: ``(batch, seq_len)`` int32 ids and mask, padded on the right
with ``[PAD]`` and mask 0 (``converters.minilm.tokenize``). Every sentence is
one segment, so the token-type embedding is row 0 of its table for every token.

Where there is a choice the layers use ops that odmlq's LiteRT path supports:
``nn.Dense`` and ``jnp.einsum`` (activation x activation for the attention),
``jax.nn.softmax`` over the last axis (keys are last: ``(b, h, q, k)``),
exact ``jax.nn.gelu`` (BERT's erf form), sums and a division for the pooling.
The embedding gather, LayerNorm's rsqrt and the L2 norm's sqrt have no such
choice.

Sharp edges:
  - Padded keys are masked by adding ``config.mask_bias`` (default -1e4, as
    BERT and the transformers version this checkpoint was trained with do) to
    their scores. In float32 their weight underflows to exactly 0, but a
    quantized model must represent that bias on the score edge: with -1e4 the
    int8 scale of the masked scores is ~40 where the scores alone need ~0.6
    (measured in layer 0), so every real score rounds to the same value.
    Choose a smaller bias when quantizing: -30 still makes a padded key's
    weight ~1e-13 (the float embeddings do not change).
  - ``attention_mask`` may be float32 (0 and 1): an int32 mask is cast inside
    the model, which a LiteRT export runs as a float CAST and QUANTIZE.
  - An all-zero mask row divides by zero in the pooling (a real tokenized
    sentence always has ``[CLS]`` and ``[SEP]``).

Example:
  >>> from converters.minilm import load_minilm, tokenize
  >>> model, variables, tokenizer, config = load_minilm()
  >>> ids, mask = tokenize(tokenizer, ["A man is playing a guitar."], seq_len=64)
  >>> embeddings = model.apply(variables, ids, mask)   # (1, 384), unit norm
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["MiniLMConfig", "MiniLM", "Embeddings", "Encoder", "Layer", "Attention"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MiniLMConfig:
    """Sizes of a BERT encoder (defaults: all-MiniLM-L6-v2's ``config.json``).

    Attributes:
      mask_bias: added to the attention scores of padded keys (see the module
        docstring on quantization).
      normalize: L2-normalize the pooled embedding (sentence-transformers'
        ``Normalize`` module). Cosine similarity does not depend on it.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    mask_bias: float = -1e4
    normalize: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MiniLMConfig.{name}={value!r}; it must be a positive int.")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"MiniLMConfig: hidden_size={self.hidden_size} is not a multiple of "
                             f"num_heads={self.num_heads}; each head takes hidden_size / num_heads.")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"MiniLMConfig.layer_norm_eps={self.layer_norm_eps!r}; it must be > 0.")
        if not self.mask_bias < 0:
            raise ValueError(f"MiniLMConfig.mask_bias={self.mask_bias!r}; it must be negative "
                             "to mask padded keys (e.g. -1e4, or -30 for quantized models).")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


def _layer_norm(config: MiniLMConfig, name: str) -> nn.LayerNorm:
    # BERT's LayerNorm: biased variance of the centred values (the two-pass
    # form; flax's default E[x^2] - E[x]^2 loses digits to cancellation).
    return nn.LayerNorm(epsilon=config.layer_norm_eps, use_fast_variance=False, name=name)


class _ClippedEmbed(nn.Embed):
    """nn.Embed whose lookup clamps ids into the table: one gather op.

    nn.Embed's own lookup (jnp.take's default fill mode) wraps negative ids and
    fills out-of-range ones with NaN, which adds integer LESS, ADD, SELECT and a
    bounds check with SELECT_V2 around the GATHER_ND of the .tflite.
    """

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, inputs, axis=0, mode="clip")


class Embeddings(nn.Module):
    """Word + position + token-type (segment 0) embeddings, then LayerNorm."""

    config: MiniLMConfig

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        c = self.config
        seq_len = input_ids.shape[1]
        if seq_len > c.max_position_embeddings:
            raise ValueError(f"seq_len {seq_len} is longer than the {c.max_position_embeddings} "
                             "positions the model has embeddings for; tokenize to a shorter length.")
        words = _ClippedEmbed(c.vocab_size, c.hidden_size, name="word_embeddings")(input_ids)
        positions = nn.Embed(c.max_position_embeddings, c.hidden_size, name="position_embeddings")
        token_types = nn.Embed(c.type_vocab_size, c.hidden_size, name="token_type_embeddings")
        # Static slices of the tables (positions 0..seq_len-1, segment 0), not
        # gathers.
        hidden = words + positions.embedding[:seq_len] + token_types.embedding[0]
        return _layer_norm(c, "layer_norm")(hidden)


class Attention(nn.Module):
    """Multi-head self-attention with an additive mask on padded keys."""

    config: MiniLMConfig

    @nn.compact
    def __call__(self, hidden: jax.Array, mask_bias: jax.Array) -> jax.Array:
        c = self.config
        batch, seq_len, _ = hidden.shape
        heads = (batch, seq_len, c.num_heads, c.head_size)
        query = nn.Dense(c.hidden_size, name="query")(hidden).reshape(heads)
        key = nn.Dense(c.hidden_size, name="key")(hidden).reshape(heads)
        value = nn.Dense(c.hidden_size, name="value")(hidden).reshape(heads)
        scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) * (1.0 / math.sqrt(c.head_size))
        # mask_bias is (batch, 1, 1, keys): 0 for real tokens, config.mask_bias for padding.
        probabilities = jax.nn.softmax(scores + mask_bias, axis=-1)
        context = jnp.einsum("bhqk,bkhd->bqhd", probabilities, value)
        return nn.Dense(c.hidden_size, name="output")(context.reshape(batch, seq_len, c.hidden_size))


class Layer(nn.Module):
    """A post-LayerNorm BERT layer: attention, then the GELU feed-forward."""

    config: MiniLMConfig

    @nn.compact
    def __call__(self, hidden: jax.Array, mask_bias: jax.Array) -> jax.Array:
        c = self.config
        attended = Attention(c, name="attention")(hidden, mask_bias)
        hidden = _layer_norm(c, "attention_layer_norm")(hidden + attended)
        intermediate = jax.nn.gelu(nn.Dense(c.intermediate_size, name="intermediate")(hidden),
                                   approximate=False)
        output = nn.Dense(c.hidden_size, name="output")(intermediate)
        return _layer_norm(c, "output_layer_norm")(hidden + output)


class Encoder(nn.Module):
    """The transformer layers, mean pooling and L2 normalization.

    Takes the embedded tokens (float, ``(batch, seq_len, hidden)``) and the
    token mask (``(batch, seq_len)``, 1 for real tokens, any dtype). On its
    own it is the model without the embedding gather:
    ``Encoder(config).apply({'params': variables['params']['encoder']}, hidden, mask)``.
    """

    config: MiniLMConfig

    @nn.compact
    def __call__(self, hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
        c = self.config
        mask = attention_mask.astype(hidden.dtype)
        mask_bias = ((1.0 - mask) * c.mask_bias)[:, None, None, :]
        for i in range(c.num_layers):
            hidden = Layer(c, name=f"layer_{i}")(hidden, mask_bias)
        # Mean over the real tokens (sentence-transformers' Pooling, mean mode).
        pooled = jnp.sum(hidden * mask[:, :, None], axis=1) / jnp.sum(mask, axis=1, keepdims=True)
        if not c.normalize:
            return pooled
        return pooled / jnp.sqrt(jnp.sum(pooled * pooled, axis=-1, keepdims=True))


class MiniLM(nn.Module):
    """Token ids and mask, ``(batch, seq_len)`` int32, to sentence embeddings ``(batch, hidden)``."""

    config: MiniLMConfig = MiniLMConfig()

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        hidden = Embeddings(self.config, name="embeddings")(input_ids)
        return Encoder(self.config, name="encoder")(hidden, attention_mask)
