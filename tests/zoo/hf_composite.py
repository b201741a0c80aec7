"""The rest of transformers' Flax families (4.x), from small configs: the pre-norm
variants and the models built of two others (an encoder of one family, a decoder
or a second tower of another), as users assemble them (TrOCR-like image-to-text,
speech-to-text, BERT2BERT, a CLIP-like dual encoder of ViT and BERT); and
diffusers' ControlNet. XLM-RoBERTa is RoBERTa's code under another name (not
repeated). Slow-marked with the other further families (`tests.zoo.models.SLOW_ZOO`)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from tests.zoo.hf_models import _audio_batches, _hf_variables, _seq2seq_batches
from tests.zoo.hf_more import _bart_family, _positions, _text
from tests.zoo.models import SEED, ZooModel, _image_batches, _tokens

_SMALL_BERT = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=128, max_position_embeddings=64)
_SMALL_VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=128)


def hf_roberta_prelayernorm() -> ZooModel:
    """RoBERTa with each sublayer's LayerNorm before it (and one after the last layer)."""
    from transformers import FlaxRobertaPreLayerNormModel, RobertaPreLayerNormConfig

    config = RobertaPreLayerNormConfig(**{**_SMALL_BERT, "max_position_embeddings": 66})
    return _text("hf_roberta_prelayernorm", FlaxRobertaPreLayerNormModel, config,
                 lambda inner, ids, mask: inner(ids, mask, jnp.zeros_like(ids), _positions(ids) + 2, None,
                                                deterministic=True, return_dict=False)[0])


def hf_blenderbot() -> ZooModel:
    """Blenderbot (the full one: pre-norm layers and a final LayerNorm, unlike BlenderbotSmall)."""
    from transformers import BlenderbotConfig, FlaxBlenderbotForConditionalGeneration

    return _bart_family("hf_blenderbot", FlaxBlenderbotForConditionalGeneration, BlenderbotConfig)


def _hf_composite_init(model_cls, config, **kwargs):
    """A composite model and its variables: these classes refuse `_do_init=False`, so
    the init runs eagerly (at the zoo's seed)."""
    hf = model_cls(config, seed=SEED, **kwargs)
    return hf, hf.params


def _with_targets(make_inputs):
    """`make_inputs`'s batches, each with 8 decoder input ids (of 1000) after its input."""
    def make(n_batches: int, batch_size: int, seed: int):
        rng = np.random.default_rng(seed + 1000)
        return [(x, _tokens(rng, batch_size, 8, 1000, min_len=8, lengths=[8] * batch_size)[0])
                for (x,) in make_inputs(n_batches, batch_size, seed)]
    return make


class ImageToText(nn.Module):
    """(pixel_values NCHW, decoder_input_ids) -> the decoder's logits."""

    inner: nn.Module

    def __call__(self, pixel_values, decoder_input_ids):
        pixels = jnp.transpose(pixel_values, (0, 2, 3, 1))  # the module reads NHWC
        return self.inner(pixels, decoder_input_ids, jnp.ones_like(decoder_input_ids),
                          _positions(decoder_input_ids), deterministic=True, return_dict=False)[0]


def hf_vision_encoder_decoder() -> ZooModel:
    """A ViT encoder and a GPT-2 decoder with cross-attention (TrOCR's and image captioning's shape)."""
    from transformers import FlaxVisionEncoderDecoderModel, GPT2Config, ViTConfig, VisionEncoderDecoderConfig

    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        ViTConfig(**_SMALL_VIT), GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    hf, params = _hf_composite_init(FlaxVisionEncoderDecoderModel, config)
    make = _with_targets(_image_batches(32, 32, 3, nchw=True, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)))
    return ZooModel("hf_vision_encoder_decoder", ImageToText(hf.module), _hf_variables(params),
                    make(1, 1, SEED + 1)[0], make, "transformer")


class SpeechToText(nn.Module):
    """(input_values, decoder_input_ids) -> the decoder's logits."""

    inner: nn.Module

    def __call__(self, input_values, decoder_input_ids):
        return self.inner(input_values, jnp.ones(input_values.shape, jnp.int32), decoder_input_ids,
                          jnp.ones_like(decoder_input_ids), _positions(decoder_input_ids), deterministic=True,
                          return_dict=False)[0]


def hf_speech_encoder_decoder() -> ZooModel:
    """A Wav2Vec2 encoder and a BART decoder with cross-attention (speech-to-text)."""
    from transformers import (BartConfig, FlaxSpeechEncoderDecoderModel, SpeechEncoderDecoderConfig,
                              Wav2Vec2Config)

    encoder = Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                             conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                             do_stable_layer_norm=True, feat_extract_norm="layer")
    decoder = BartConfig(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                         decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=1, pad_token_id=0)
    config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    hf, params = _hf_composite_init(FlaxSpeechEncoderDecoderModel, config, input_shape=((1, 1600), (1, 8)))
    make = _with_targets(_audio_batches(1600))
    return ZooModel("hf_speech_encoder_decoder", SpeechToText(hf.module), _hf_variables(params),
                    make(1, 1, SEED + 1)[0], make, "audio")


class TextToText(nn.Module):
    """(input_ids, attention_mask, decoder_input_ids) -> the decoder's logits (EncoderDecoder's order)."""

    inner: nn.Module

    def __call__(self, input_ids, attention_mask, decoder_input_ids):
        return self.inner(input_ids, attention_mask, decoder_input_ids, jnp.ones_like(decoder_input_ids),
                          _positions(input_ids), _positions(decoder_input_ids), deterministic=True,
                          return_dict=False)[0]


def hf_encoder_decoder() -> ZooModel:
    """BERT2GPT2: a BERT encoder and a GPT-2 decoder with cross-attention (EncoderDecoderModel)."""
    from transformers import BertConfig, EncoderDecoderConfig, FlaxEncoderDecoderModel, GPT2Config

    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**_SMALL_BERT), GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    hf, params = _hf_composite_init(FlaxEncoderDecoderModel, config)
    make = _seq2seq_batches(16, 8, 1000)
    return ZooModel("hf_encoder_decoder", TextToText(hf.module), _hf_variables(params), make(1, 1, SEED + 1)[0],
                    make, "transformer")


class DualEncoder(nn.Module):
    """(input_ids, attention_mask, pixel_values NCHW) -> the text and image embeddings, each
    projected and normalized (what retrieval stores and compares), side by side."""

    inner: nn.Module

    def __call__(self, input_ids, attention_mask, pixel_values):
        pixels = jnp.transpose(pixel_values, (0, 2, 3, 1))  # the module reads NHWC
        out = self.inner(input_ids, pixels, attention_mask, _positions(input_ids), jnp.zeros_like(input_ids),
                         deterministic=True, return_dict=False)
        return jnp.concatenate([out[2], out[3]], axis=-1)


def hf_vision_text_dual_encoder() -> ZooModel:
    """A ViT image tower and a BERT text tower, each projected and normalized (a CLIP-like pair)."""
    from transformers import BertConfig, FlaxVisionTextDualEncoderModel, ViTConfig, VisionTextDualEncoderConfig

    config = VisionTextDualEncoderConfig.from_vision_text_configs(ViTConfig(**_SMALL_VIT), BertConfig(**_SMALL_BERT),
                                                                  projection_dim=32)
    hf, params = _hf_composite_init(FlaxVisionTextDualEncoderModel, config)
    images = _image_batches(32, 32, 3, nchw=True, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))

    def make(n_batches: int, batch_size: int, seed: int):
        rng = np.random.default_rng(seed + 1000)
        out = []
        for (pixels,) in images(n_batches, batch_size, seed):
            ids, mask = _tokens(rng, batch_size, 16, 1000, min_len=8)
            out.append((ids, mask, pixels))
        return out
    return ZooModel("hf_vision_text_dual_encoder", DualEncoder(hf.module), _hf_variables(params),
                    make(1, 1, SEED + 1)[0], make, "class_token")


COMPOSITE = {f.__name__: f for f in (
    hf_roberta_prelayernorm, hf_blenderbot, hf_vision_encoder_decoder, hf_speech_encoder_decoder,
    hf_encoder_decoder, hf_vision_text_dual_encoder)}
