"""A decoder-only TransformerLM in Linen, as Flax's examples/lm1b/models.py writes it (the zoo's
``transformer_lm_linen``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tests.zoo.models import ZooModel, _key, _token_batches, _token_example


@flax.struct.dataclass
class TransformerConfig:
    vocab_size: int = 1000
    output_vocab_size: int = 1000
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 64
    mlp_dim: int = 256
    max_len: int = 64
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = True
    decode: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
    """Shift the input to the right by padding and slicing on axis."""
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return jax.lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
    def init(key, shape, dtype=np.float32):
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2: 2 * (d_feature // 2)] = np.cos(position * div_term)
        return jnp.array(pe[np.newaxis, :, :])
    return init


class AddPositionEmbs(nn.Module):
    """Adds (fixed sinusoidal) positional embeddings to the inputs."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        length = inputs.shape[1]
        pos_emb_shape = (1, self.config.max_len, inputs.shape[-1])
        pos_embedding = sinusoidal_init(max_len=self.config.max_len)(None, pos_emb_shape, None)
        return inputs + pos_embedding[:, :length, :]


class MlpBlock(nn.Module):
    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(config.mlp_dim, dtype=config.dtype,
                     kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(config.bias_init, ("mlp",)))(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        output = nn.Dense(actual_out_dim, dtype=config.dtype,
                          kernel_init=nn.with_logical_partitioning(config.kernel_init, ("mlp", "embed")),
                          bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)))(x)
        return nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        config = self.config
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "kv")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("embed",)),
            use_bias=False, broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic, decode=config.decode)(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs
        z = nn.LayerNorm(dtype=config.dtype)(x)
        z = MlpBlock(config=config)(z)
        return x + z


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        config = self.config
        y = inputs.astype("int32")
        if not config.decode:
            y = shift_right(y)
        output_embed = nn.Embed(
            num_embeddings=config.output_vocab_size, features=config.emb_dim,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                                        ("vocab", "embed")),
            name="embed")
        y = output_embed(y)
        y = AddPositionEmbs(config=config, name="posembed_output")(y)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        for lyr in range(config.num_layers):
            y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(y, decoder_mask)
        y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)
        if config.logits_via_embedding:
            logits = output_embed.attend(y.astype(jnp.float32))
            logits = logits / jnp.sqrt(y.shape[-1])
        else:
            logits = nn.Dense(config.output_vocab_size, dtype=config.dtype,
                              kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "vocab")),
                              bias_init=nn.with_logical_partitioning(config.bias_init, ("vocab",)),
                              name="logitdense")(y)
        return logits


class TransformerLM(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        if config.decode:
            decoder_mask = None
        else:
            decoder_mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
                nn.make_causal_mask(inputs, dtype=config.dtype))
        return Decoder(config=config, name="decoder")(inputs, decoder_mask=decoder_mask)


def transformer_lm_linen() -> ZooModel:
    config = TransformerConfig()
    model = TransformerLM(config)
    seq = 16
    example = _token_example(seq, config.vocab_size, with_mask=False)
    variables = jax.jit(model.init)(_key(), example[0])  # kept boxed (LogicallyPartitioned)
    make = _token_batches(seq, config.vocab_size, with_mask=False)
    return ZooModel("transformer_lm_linen", model, variables, example, make, "transformer")
