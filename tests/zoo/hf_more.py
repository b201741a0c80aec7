"""More of transformers' Flax models (4.x), from small configs: the families the
first zoo (`tests.zoo.hf_models`) does not cover. Each wrapper maps the zoo's
inputs to the model's own keyword arguments (`HFCall`).

Not here: T5, mT5, LongT5 and RoFormer. transformers 4.47.1's Flax code for them
does not run in float under jax 0.10 (``jnp.clip(a_max=...)``, ``tracer.split``)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from tests.zoo.hf_models import _hf_init, _hf_variables, _seq2seq_batches, HFSeq2SeqModel
from tests.zoo.models import (SEED, ZooModel, _image_batches, _token_batches, _token_example,
                              randomize_batchnorm_linen)


class HFCall(nn.Module):
    """``call(inner, *inputs)``: the zoo's inputs to the inner module's own arguments."""

    inner: nn.Module
    call: Callable[..., Any]

    def __call__(self, *inputs):
        return self.call(self.inner, *inputs)


def _positions(ids):
    return jnp.broadcast_to(jnp.arange(ids.shape[-1]), ids.shape)


def _text(name: str, model_cls, config, call, seq: int = 16) -> ZooModel:
    hf, params = _hf_init(model_cls, config)
    return ZooModel(name, HFCall(hf.module, call), _hf_variables(params),
                    _token_example(seq, config.vocab_size, with_mask=True),
                    _token_batches(seq, config.vocab_size, with_mask=True), "transformer")


def _bert_like(inner, ids, mask):
    return inner(ids, mask, jnp.zeros_like(ids), _positions(ids), deterministic=True, return_dict=False)[0]


def _ids_mask_positions(inner, ids, mask):
    return inner(ids, mask, _positions(ids), deterministic=True, return_dict=False)[0]


def hf_roberta() -> ZooModel:
    from transformers import FlaxRobertaModel, RobertaConfig

    return _text("hf_roberta", FlaxRobertaModel, RobertaConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=66), lambda inner, ids, mask: inner(
            ids, mask, jnp.zeros_like(ids), _positions(ids) + 2, None, deterministic=True, return_dict=False)[0])


def hf_albert() -> ZooModel:
    """ALBERT: factorized embeddings (128 -> hidden) and one layer's weights shared by all layers."""
    from transformers import AlbertConfig, FlaxAlbertModel

    return _text("hf_albert", FlaxAlbertModel, AlbertConfig(
        vocab_size=1000, embedding_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64), _bert_like)


def hf_electra() -> ZooModel:
    from transformers import ElectraConfig, FlaxElectraModel

    return _text("hf_electra", FlaxElectraModel, ElectraConfig(
        vocab_size=1000, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=64),
        lambda inner, ids, mask: inner(ids, mask, jnp.zeros_like(ids), _positions(ids), None,
                                       deterministic=True, return_dict=False)[0])


def hf_bigbird() -> ZooModel:
    """BigBird with block-sparse attention (random blocks drawn at trace time)."""
    from transformers import BigBirdConfig, FlaxBigBirdModel

    config = BigBirdConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=128, max_position_embeddings=128, attention_type="block_sparse",
                           block_size=4, num_random_blocks=2)
    return _text("hf_bigbird", FlaxBigBirdModel, config,
                 lambda inner, ids, mask: inner(ids, mask, jnp.zeros_like(ids), _positions(ids), None,
                                                deterministic=True, return_dict=False)[0], seq=64)


def _bart_family(name: str, model_cls, config_cls, **extra) -> ZooModel:
    config = config_cls(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=1, pad_token_id=0,
                        **extra)
    hf, params = _hf_init(model_cls, config)
    make = _seq2seq_batches(16, 8, config.vocab_size)
    return ZooModel(name, HFSeq2SeqModel(hf.module), _hf_variables(params), make(1, 1, SEED + 1)[0], make,
                    "transformer")


def hf_bart() -> ZooModel:
    from transformers import BartConfig, FlaxBartForConditionalGeneration

    return _bart_family("hf_bart", FlaxBartForConditionalGeneration, BartConfig)


def hf_mbart() -> ZooModel:
    """mBART: pre-norm layers and a final LayerNorm in encoder and decoder."""
    from transformers import FlaxMBartForConditionalGeneration, MBartConfig

    return _bart_family("hf_mbart", FlaxMBartForConditionalGeneration, MBartConfig)


def hf_pegasus() -> ZooModel:
    from transformers import FlaxPegasusForConditionalGeneration, PegasusConfig

    return _bart_family("hf_pegasus", FlaxPegasusForConditionalGeneration, PegasusConfig)


def hf_blenderbot_small() -> ZooModel:
    from transformers import BlenderbotSmallConfig, FlaxBlenderbotSmallForConditionalGeneration

    return _bart_family("hf_blenderbot_small", FlaxBlenderbotSmallForConditionalGeneration,
                        BlenderbotSmallConfig)


def hf_opt() -> ZooModel:
    from transformers import FlaxOPTForCausalLM, OPTConfig

    return _text("hf_opt", FlaxOPTForCausalLM, OPTConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64), _ids_mask_positions)


def hf_xglm() -> ZooModel:
    from transformers import FlaxXGLMForCausalLM, XGLMConfig

    return _text("hf_xglm", FlaxXGLMForCausalLM, XGLMConfig(
        vocab_size=1000, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=64),
        _ids_mask_positions)


def hf_mistral() -> ZooModel:
    """Mistral: a sliding-window causal mask, grouped-query attention."""
    from transformers import FlaxMistralForCausalLM, MistralConfig

    return _text("hf_mistral", FlaxMistralForCausalLM, MistralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=8), _ids_mask_positions)


def hf_gemma() -> ZooModel:
    """transformers' Gemma: (1 + weight) RMSNorm, embeddings scaled by sqrt(hidden), GELU-gated MLP."""
    from transformers import FlaxGemmaForCausalLM, GemmaConfig

    return _text("hf_gemma", FlaxGemmaForCausalLM, GemmaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64), _ids_mask_positions)


def hf_clip_text() -> ZooModel:
    """CLIP's text tower: causal mask, quick-GELU, the pooled token taken by argmax of the ids."""
    from transformers import CLIPTextConfig, FlaxCLIPTextModel

    return _text("hf_clip_text", FlaxCLIPTextModel, CLIPTextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64),
        lambda inner, ids, mask: inner(ids, mask, _positions(ids), deterministic=True, return_dict=False)[1])


class HFImage(nn.Module):
    """pixel_values (NCHW, or NHWC where ``nhwc``) -> the output at ``index``."""

    inner: nn.Module
    index: int = 0
    nhwc: bool = True

    def __call__(self, pixel_values):
        x = jnp.transpose(pixel_values, (0, 2, 3, 1)) if self.nhwc else pixel_values
        return self.inner(x, deterministic=True, return_dict=False)[self.index]


def _image(name: str, model_cls, config, *, index: int = 0, size: int = 32, nhwc: bool = True,
           family: str = "transformer", batchnorm: bool = False, **init) -> ZooModel:
    hf, params = _hf_init(model_cls, config, **init)
    variables = _hf_variables(params)
    if batchnorm:
        variables = randomize_batchnorm_linen(variables)
    make = _image_batches(size, size, 3, nchw=True, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    return ZooModel(name, HFImage(hf.module, index, nhwc), variables, make(1, 1, SEED + 1)[0], make, family)


def hf_clip_vision() -> ZooModel:
    """CLIP's vision tower, its pooled output: the class token after a LayerNorm
    before the encoder (``pre_layrnorm``) and one after it."""
    from transformers import CLIPVisionConfig, FlaxCLIPVisionModel

    return _image("hf_clip_vision", FlaxCLIPVisionModel, CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
        patch_size=8), index=1, family="class_token")


def hf_dinov2() -> ZooModel:
    """DINOv2: layer scale, position embeddings interpolated (bicubic) to the image's patches."""
    from transformers import Dinov2Config, FlaxDinov2Model

    return _image("hf_dinov2", FlaxDinov2Model, Dinov2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=32, patch_size=8),
        index=1)


def hf_beit() -> ZooModel:
    """BEiT: a relative position bias table per layer, layer scale, mean-pooled head.

    Its class token initializes to zeros: a row of zero variance, whose LayerNorm
    reads rsqrt(eps) = 1e6 and no trained BEiT has. It is drawn here (std 0.02, as
    trained class tokens are of the order of the embeddings)."""
    from transformers import BeitConfig, FlaxBeitForImageClassification

    z = _image("hf_beit", FlaxBeitForImageClassification, BeitConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, use_relative_position_bias=True, num_labels=10), family="mean_pooled")
    embeddings = z.variables["params"]["inner"]["beit"]["embeddings"]
    token = embeddings["cls_token"]
    embeddings["cls_token"] = 0.02 * jax.random.normal(jax.random.PRNGKey(SEED), token.shape, token.dtype)
    return z


def hf_regnet() -> ZooModel:
    """RegNet: grouped 3x3 convolutions and squeeze-excite, BatchNorm."""
    from transformers import FlaxRegNetForImageClassification, RegNetConfig

    config = RegNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 2, 1],
                          groups_width=8, layer_type="y", num_labels=10)
    return _image("hf_regnet", FlaxRegNetForImageClassification, config, family="cnn", batchnorm=True,
                  input_shape=(1, 32, 32, 3))


class WhisperModel(nn.Module):
    inner: nn.Module

    def __call__(self, input_features, decoder_input_ids):
        return self.inner(input_features, decoder_input_ids, jnp.ones_like(decoder_input_ids),
                          _positions(decoder_input_ids), deterministic=True, return_dict=False)[0]


def hf_whisper() -> ZooModel:
    """Whisper: log-mel features through two 1-D convolutions (GELU), sinusoidal positions,
    then an encoder-decoder."""
    import numpy as np
    from transformers import FlaxWhisperForConditionalGeneration, WhisperConfig

    config = WhisperConfig(vocab_size=1000, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, d_model=64, max_source_positions=32, max_target_positions=16,
                           decoder_start_token_id=1, pad_token_id=0)
    hf, params = _hf_init(FlaxWhisperForConditionalGeneration, config, input_shape=(1, 16, 64))

    def make(n_batches: int, batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n_batches):
            mel = np.clip(rng.normal(0, 0.4, (batch_size, 16, 64)).cumsum(-1) * 0.2, -1, 1).astype(np.float32)
            ids = rng.integers(2, 1000, (batch_size, 8)).astype(np.int32)
            out.append((mel, ids))
        return out
    return ZooModel("hf_whisper", WhisperModel(hf.module), _hf_variables(params), make(1, 1, SEED + 1)[0], make,
                    "audio")


MORE = {f.__name__: f for f in (
    hf_roberta, hf_albert, hf_electra, hf_bigbird, hf_bart, hf_mbart,
    hf_pegasus, hf_blenderbot_small, hf_opt, hf_xglm, hf_mistral, hf_gemma, hf_clip_text, hf_clip_vision,
    hf_dinov2, hf_beit, hf_regnet, hf_whisper)}
