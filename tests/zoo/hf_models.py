"""transformers' Flax models of the zoo (4.x; transformers 5 has no Flax), from small
configs: see `tests.zoo.models` for what each wrapper builds. transformers is
imported lazily, in each builder. Import the zoo from `tests.zoo.models`, which
imports this module once its helpers exist."""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tests.zoo.models import (SEED, ZooModel, _image_batches, _key, _token_batches, _token_example, _tokens,
                              randomize_batchnorm_linen)


class HFTextModel(nn.Module):
    """(input_ids, attention_mask) -> the inner module's first output."""

    inner: nn.Module
    token_type_ids: bool = True  # BERT takes them; GPT-2 does not
    position_ids: bool = True  # DistilBERT and BLOOM take neither

    def __call__(self, input_ids, attention_mask):
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        if not self.position_ids:
            out = self.inner(input_ids, attention_mask, deterministic=True, return_dict=False)
        elif self.token_type_ids:
            out = self.inner(input_ids, attention_mask, jnp.zeros_like(input_ids), position_ids,
                             deterministic=True, return_dict=False)
        else:
            out = self.inner(input_ids, attention_mask, position_ids, deterministic=True,
                             return_dict=False)
        return out[0]


class HFImageModel(nn.Module):
    """pixel_values (NCHW, as transformers' Flax vision models take them) -> logits."""

    inner: nn.Module

    def __call__(self, pixel_values):
        x = jnp.transpose(pixel_values, (0, 2, 3, 1))
        return self.inner(x, deterministic=True, return_dict=False)[0]


class HFSeq2SeqModel(nn.Module):
    """(input_ids, attention_mask, decoder_input_ids) -> the decoder's first output
    (BART-style models: positions and the decoder's mask built inside)."""

    inner: nn.Module

    def __call__(self, input_ids, attention_mask, decoder_input_ids):
        def positions(ids):
            return jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)

        out = self.inner(input_ids, attention_mask, decoder_input_ids, jnp.ones_like(decoder_input_ids),
                         positions(input_ids), positions(decoder_input_ids), deterministic=True,
                         return_dict=False)
        return out[0]


class HFAudioModel(nn.Module):
    """input_values (batch, samples) -> the encoder's last hidden state."""

    inner: nn.Module

    def __call__(self, input_values):
        return self.inner(input_values, deterministic=True, return_dict=False)[0]


def _seq2seq_batches(seq: int, target: int, vocab: int):
    def make(n_batches: int, batch_size: int, seed: int) -> list[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n_batches):
            ids, mask = _tokens(rng, batch_size, seq, vocab, min_len=seq // 2)
            decoder_ids, _ = _tokens(rng, batch_size, target, vocab, min_len=target, lengths=[target] * batch_size)
            out.append((ids, mask, decoder_ids))
        return out
    return make


def _audio_batches(samples: int):
    """Audio-like float32 waves: a few tones of random pitch and loudness, and noise,
    each normalized to zero mean and unit variance (as Wav2Vec2's feature extractor does)."""
    def make(n_batches: int, batch_size: int, seed: int) -> list[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        t = np.arange(samples) / 16000.0
        out = []
        for _ in range(n_batches):
            pitch = rng.uniform(80, 2000, (batch_size, 3, 1))
            loud = rng.uniform(0.05, 0.5, (batch_size, 3, 1))
            wave = (loud * np.sin(2 * np.pi * pitch * t + rng.uniform(0, 6.3, (batch_size, 3, 1)))).sum(1)
            wave = wave + 0.02 * rng.standard_normal(wave.shape)
            wave = (wave - wave.mean(1, keepdims=True)) / np.sqrt(wave.var(1, keepdims=True) + 1e-7)
            out.append((wave.astype(np.float32),))
        return out
    return make


def _hf_init(model_cls, config, **kwargs):
    """`model_cls(config)` without its eager init, and its variables (init jitted)."""
    hf = model_cls(config, _do_init=False, **kwargs)
    params = jax.jit(hf.init_weights, static_argnums=1)(_key(), hf.input_shape)
    return hf, params


def _hf_variables(params) -> dict:
    """{'params': {'inner': ...}} (and batch_stats) for a wrapper around the HF module."""
    params = flax.core.unfreeze(params)
    if "batch_stats" in params:  # FlaxResNet keeps both collections in .params
        return {"params": {"inner": params["params"]}, "batch_stats": {"inner": params["batch_stats"]}}
    return {"params": {"inner": params}}


def hf_bert() -> ZooModel:
    from transformers import BertConfig, FlaxBertModel

    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, type_vocab_size=2)
    hf, params = _hf_init(FlaxBertModel, config)
    model = HFTextModel(hf.module, token_type_ids=True)
    seq = 16
    return ZooModel("hf_bert", model, _hf_variables(params), _token_example(seq, 1000, with_mask=True),
                    _token_batches(seq, 1000, with_mask=True), "transformer")


def hf_gpt2() -> ZooModel:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    hf, params = _hf_init(FlaxGPT2LMHeadModel, config)
    model = HFTextModel(hf.module, token_type_ids=False)
    seq = 16
    return ZooModel("hf_gpt2", model, _hf_variables(params), _token_example(seq, 1000, with_mask=True),
                    _token_batches(seq, 1000, with_mask=True), "transformer")


def _hf_causal_lm(name: str, model_cls, config, position_ids: bool = True) -> ZooModel:
    """A transformers Flax causal LM (or encoder) on (input_ids, attention_mask) of 16 tokens."""
    hf, params = _hf_init(model_cls, config)
    seq = 16
    return ZooModel(name, HFTextModel(hf.module, token_type_ids=False, position_ids=position_ids),
                    _hf_variables(params),
                    _token_example(seq, config.vocab_size, with_mask=True),
                    _token_batches(seq, config.vocab_size, with_mask=True), "transformer")


def hf_llama() -> ZooModel:
    """Llama's blocks as transformers writes them in Flax: RMSNorm with ``x ** 2``,
    rotate-half rotary embeddings (a negation) from a constant table, grouped-query
    attention (``jnp.repeat`` of the key/value heads), a SiLU-gated MLP."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    return _hf_causal_lm("hf_llama", FlaxLlamaForCausalLM, LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def hf_gpt_neo() -> ZooModel:
    """GPT-Neo: global and local attention layers (the local mask is a xor of booleans)."""
    from transformers import FlaxGPTNeoForCausalLM, GPTNeoConfig

    return _hf_causal_lm("hf_gpt_neo", FlaxGPTNeoForCausalLM, GPTNeoConfig(
        vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        max_position_embeddings=64, window_size=8))


def hf_distilbert() -> ZooModel:
    """DistilBERT: attention by ``jnp.matmul`` (its ops differ at batch 1, which drops
    batch axes of size 1), an int32 mask cast to float and subtracted as ``1e30 * (1 - m)``."""
    from transformers import DistilBertConfig, FlaxDistilBertModel

    return _hf_causal_lm("hf_distilbert", FlaxDistilBertModel, DistilBertConfig(
        vocab_size=1000, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64),
        position_ids=False)


def hf_bloom() -> ZooModel:
    """BLOOM: ALiBi position biases built from the int32 mask (a CAST to float)."""
    from transformers import BloomConfig, FlaxBloomForCausalLM

    return _hf_causal_lm("hf_bloom", FlaxBloomForCausalLM, BloomConfig(
        vocab_size=1000, hidden_size=64, n_layer=2, n_head=4), position_ids=False)


def hf_gptj() -> ZooModel:
    """GPT-J: an interleaved rotary embedding that ends in ``jnp.stack``."""
    from transformers import FlaxGPTJForCausalLM, GPTJConfig

    return _hf_causal_lm("hf_gptj", FlaxGPTJForCausalLM, GPTJConfig(
        vocab_size=1000, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64))


def hf_vit() -> ZooModel:
    from transformers import FlaxViTForImageClassification, ViTConfig

    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_labels=10)
    hf, params = _hf_init(FlaxViTForImageClassification, config)
    model = HFImageModel(hf.module)
    make = _image_batches(32, 32, 3, nchw=True, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    return ZooModel("hf_vit", model, _hf_variables(params), make(1, 1, SEED + 1)[0], make, "transformer")


def hf_resnet() -> ZooModel:
    from transformers import FlaxResNetForImageClassification, ResNetConfig

    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                          depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)
    hf, params = _hf_init(FlaxResNetForImageClassification, config, input_shape=(1, 32, 32, 3))
    model = HFImageModel(hf.module)
    variables = randomize_batchnorm_linen(_hf_variables(params))
    make = _image_batches(32, 32, 3, nchw=True, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    return ZooModel("hf_resnet", model, variables, make(1, 1, SEED + 1)[0], make, "cnn")


def hf_marian() -> ZooModel:
    """Marian (BART-style encoder-decoder): sinusoidal positions, a constant table taken
    at constant positions, and a causal mask folded to a constant of 0 and finfo.min."""
    from transformers import FlaxMarianMTModel, MarianConfig

    config = MarianConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=1,
                          pad_token_id=0)
    hf, params = _hf_init(FlaxMarianMTModel, config)
    make = _seq2seq_batches(16, 8, config.vocab_size)
    return ZooModel("hf_marian", HFSeq2SeqModel(hf.module), _hf_variables(params), make(1, 1, SEED + 1)[0],
                    make, "transformer")


def hf_wav2vec2() -> ZooModel:
    """Wav2Vec2: a feature extractor of strided 1-D convolutions with LayerNorm, a grouped
    1-D positional convolution, then a transformer encoder."""
    from transformers import FlaxWav2Vec2Model, Wav2Vec2Config

    config = Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                            do_stable_layer_norm=True, feat_extract_norm="layer")
    hf, params = _hf_init(FlaxWav2Vec2Model, config, input_shape=(1, 1600))
    make = _audio_batches(1600)
    return ZooModel("hf_wav2vec2", HFAudioModel(hf.module), _hf_variables(params), make(1, 1, SEED + 1)[0],
                    make, "audio")
