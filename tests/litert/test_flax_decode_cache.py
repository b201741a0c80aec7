"""Flax's own autoregressive decoding, exported as it is written: a Linen decoder
built with ``decode=True`` keeps its keys, values and position in the 'cache'
collection (``nn.SelfAttention(decode=True)``, as Flax's lm1b and WMT examples
decode), applied with ``mutable=['cache']``. The one-token step is a function
of the params, the token and the cache that returns the logits and the new
cache; the .tflite takes the cache's arrays and writes them back, its
``cache_index`` a scalar every row shares."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

import odmlq

VOCAB, LENGTH, FEATURES = 48, 12, 32


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + nn.SelfAttention(num_heads=4, qkv_features=FEATURES, decode=True, deterministic=True,
                                 name="attention")(nn.LayerNorm(name="attention_norm")(x))
        h = nn.gelu(nn.Dense(2 * FEATURES, name="up")(nn.LayerNorm(name="mlp_norm")(x)))
        return x + nn.Dense(FEATURES, name="down")(h)


class _Decoder(nn.Module):
    """lm1b's decoder in small: a learned position table read at the cache's index with
    ``lax.dynamic_slice``, pre-norm blocks, logits through the tied embedding."""

    @nn.compact
    def __call__(self, token):
        embed = nn.Embed(VOCAB, FEATURES, name="embed")
        table = self.param("positions", nn.initializers.normal(0.2), (1, LENGTH, FEATURES))
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        position = jax.lax.dynamic_slice(table, (0, index.value, 0), (1, 1, FEATURES))
        if not self.is_initializing():
            index.value = index.value + 1
        x = embed(token) + position
        for i in range(2):
            x = _Block(name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="final_norm")(x))


MODEL = _Decoder()


def step(params, token, cache):
    """One token: the logits of the next, and the cache written."""
    logits, written = MODEL.apply({"params": params, "cache": cache}, token, mutable=["cache"])
    return logits[:, 0], written["cache"]


@pytest.fixture(scope="module")
def decoder():
    # The cache is as long as the sequence initialized with (Flax sizes it so).
    variables = MODEL.init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32))
    params, empty = variables["params"], variables["cache"]
    jitted = jax.jit(step)
    states = []  # (token, cache) before each step of greedy decoding from 5 prompts' first tokens
    for first in (3, 11, 20, 31, 47):
        token, cache = np.array([[first]], np.int32), empty
        for _ in range(6):
            states.append((token, jax.tree_util.tree_map(np.asarray, cache)))
            logits, cache = jitted(params, token, cache)
            token = np.asarray(jnp.argmax(logits, -1))[:, None].astype(np.int32)
    return params, empty, jitted, states


def _greedy_litert(tflite: bytes, first: int, empty, steps: int) -> list[int]:
    """Greedy decoding driven by the interpreter: each step's cache written back as the next's."""
    runner = Interpreter(model_content=tflite).get_signature_runner("serving_default")
    leaves, tree = jax.tree_util.tree_flatten(empty)
    names = odmlq.batches.leaf_names((np.zeros((1, 1), np.int32), empty), ["token", "cache"])
    token, tokens = np.array([[first]], np.int32), []
    for _ in range(steps):
        out = runner(**dict(zip(names, [token, *[np.asarray(x) for x in leaves]])))
        logits, *leaves = [out[f"output_{i}"] for i in range(len(out))]
        token = np.argmax(logits, -1)[:, None].astype(np.int32)
        tokens.append(int(token[0, 0]))
    return tokens


def _greedy_float(jitted, params, first: int, empty, steps: int) -> list[int]:
    token, cache, tokens = np.array([[first]], np.int32), empty, []
    for _ in range(steps):
        logits, cache = jitted(params, token, cache)
        token = np.asarray(jnp.argmax(logits, -1))[:, None].astype(np.int32)
        tokens.append(int(token[0, 0]))
    return tokens


@pytest.mark.parametrize("rules", [
    [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
    [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
], ids=["dynamic", "int8"])
def test_a_decode_true_model_exports_its_step_with_its_cache_and_decodes_greedily(decoder, rules):
    """Before: the rep_dataset's scalar cache index was refused ('with the batch dimension
    first'), and int8 refused the position table's dynamic_slice. The file's inputs are named
    after the step's arguments and the cache's keys; fed its own cache back, it decodes the
    float model's tokens (dynamic range: outputs 51 dB from float, measured; int8: its
    logits' argmax over 8 steps from 2 prompts, measured equal)."""
    params, empty, jitted, states = decoder
    # state={1: 1}: the cache returned (output 1) is the cache given back (argument 1), one tensor
    # and one scale across calls.
    plan = odmlq.plan(step, rules, *states[0], variables=params, target="litert", state={1: 1})
    result = odmlq.export_tflite(step, plan, states, variables=params, progress=False, benchmark=False)
    assert result.verification.passed and result.summary.float_islands == (), str(result.verification)
    assert "DYNAMIC_UPDATE_SLICE" in result.summary.op_histogram
    names = list(Interpreter(model_content=result.tflite).get_signature_runner("serving_default").get_input_details())
    assert "token" in names and "cache_block_0_attention_cached_key" in names and "cache_cache_index" in names, names
    for first in (5, 40):
        assert _greedy_litert(result.tflite, first, empty, 8) == _greedy_float(jitted, params, first, empty, 8)
