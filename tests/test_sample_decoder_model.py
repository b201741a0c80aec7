"""samples/decoder_model.py against an independent float64 numpy decoder, and its cache against no cache."""

import jax
import numpy as np
import pytest

from samples.decoder_model import Decoder, DecoderConfig

CONFIG = DecoderConfig(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_hidden=96, cache_length=24)


def _reference(params: dict, config: DecoderConfig, tokens: np.ndarray) -> np.ndarray:
    """Logits of every position, written from the published description of a Llama block
    (pre-norm RMSNorm, rotate-half RoPE, grouped-query causal attention, SwiGLU MLP, tied
    output embedding), one loop per head, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    emb = p["embedding"]["embedding"]
    batch, length = tokens.shape
    d, h, kvh = config.head_dim, config.heads, config.kv_heads

    def rms(x, scale):
        return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + config.norm_eps) * scale

    def rope(x):  # (length, heads, d)
        out = np.empty_like(x)
        for pos in range(x.shape[0]):
            for i in range(d // 2):
                angle = pos * config.rope_base ** (-i / (d // 2))
                a, b = x[pos, :, i], x[pos, :, i + d // 2]
                out[pos, :, i] = a * np.cos(angle) - b * np.sin(angle)
                out[pos, :, i + d // 2] = b * np.cos(angle) + a * np.sin(angle)
        return out

    logits = np.empty((batch, length, config.vocab_size))
    for row in range(batch):
        x = emb[tokens[row]] * np.sqrt(config.hidden)
        for layer in range(config.layers):
            lp = p[f"layer_{layer}"]
            a = lp["attention"]
            hx = rms(x, lp["attention_norm"]["scale"])
            q = rope((hx @ a["query"]["kernel"]).reshape(length, h, d))
            k = rope((hx @ a["key"]["kernel"]).reshape(length, kvh, d))
            v = (hx @ a["value"]["kernel"]).reshape(length, kvh, d)
            heads = np.empty((length, h, d))
            for head in range(h):
                kv = head // (h // kvh)
                scores = q[:, head] @ k[:, kv].T / np.sqrt(d)
                scores = np.where(np.tril(np.ones((length, length))) > 0, scores, -np.inf)
                w = np.exp(scores - scores.max(axis=1, keepdims=True))
                heads[:, head] = (w / w.sum(axis=1, keepdims=True)) @ v[:, kv]
            x = x + heads.reshape(length, h * d) @ a["output"]["kernel"]
            m = rms(x, lp["mlp_norm"]["scale"])
            gate, up = m @ lp["gate"]["kernel"], m @ lp["up"]["kernel"]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ lp["down"]["kernel"]
        logits[row] = rms(x, p["final_norm"]["scale"]) @ emb.T
    return logits


def _model():
    model = Decoder(CONFIG)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 10)).astype(np.int32)
    variables = model.init(jax.random.key(0), tokens)
    # Norm scales away from 1, so a missing scale shows.
    variables = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (1 + 0.1 * np.sin(np.arange(x.size))).reshape(x.shape) if "scale" in str(path) else x,
        variables)
    return model, variables, tokens


def test_logits_match_an_independent_float64_decoder():
    model, variables, tokens = _model()
    logits = np.asarray(model.apply(variables, tokens), np.float64)
    reference = _reference(variables["params"], CONFIG, tokens)
    # float32 against float64 through 2 layers: relative to the logits' spread.
    np.testing.assert_allclose(logits, reference, atol=1e-4 * np.abs(reference).max(), rtol=0)


def test_prefill_then_decode_equals_the_uncached_logits():
    model, variables, tokens = _model()
    full = np.asarray(model.apply(variables, tokens))
    logits, *cache = model.apply(variables, tokens[:, :6], *model.empty_cache(2), method="prefill")
    np.testing.assert_allclose(np.asarray(logits), full[:, :6], atol=1e-5, rtol=1e-5)
    for position in range(6, 10):
        logits, *cache = model.apply(variables, tokens[:, position:position + 1],
                                     np.full((2,), position, np.int32), *cache, method="decode")
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, position], atol=1e-5, rtol=1e-5)
    assert len(cache) == 2 * CONFIG.layers and model.cache_names()[:3] == ["keys_0", "values_0", "keys_1"]
    for x in cache:
        assert x.shape == (2, CONFIG.kv_heads, CONFIG.cache_length, CONFIG.head_dim)
        assert np.any(np.asarray(x)[:, :, 9]) and not np.any(np.asarray(x)[:, :, 10:])  # written up to 9 only


def test_a_cache_of_the_wrong_length_is_named():
    model, variables, tokens = _model()
    with pytest.raises(ValueError, match="has 2 layers: give 4 cache tensors .keys_0, values_0, keys_1, values_1"):
        model.apply(variables, tokens, *model.empty_cache(2)[:2], method="prefill")


def test_rows_decode_at_their_own_positions():
    model, variables, tokens = _model()
    full = np.asarray(model.apply(variables, tokens))
    _, *cache = model.apply(variables, tokens[:, :6], *model.empty_cache(2), method="prefill")
    # Row 0 decodes position 6; row 1 re-decodes position 3 over its own cache (3..5 overwritten
    # with the same keys: its logits at 3 see positions 0..3 only).
    logits, *_ = model.apply(variables, np.stack([tokens[0, 6:7], tokens[1, 3:4]]), np.array([6, 3], np.int32),
                             *cache, method="decode")
    np.testing.assert_allclose(np.asarray(logits)[0, 0], full[0, 6], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logits)[1, 0], full[1, 3], atol=1e-5, rtol=1e-5)


def test_a_config_that_cannot_be_built_is_refused():
    with pytest.raises(ValueError, match="heads=6 is not a multiple of kv_heads=4"):
        DecoderConfig(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="give an even head_dim"):
        DecoderConfig(head_dim=15)
