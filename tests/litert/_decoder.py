"""A tiny decoder with prefill and decode data, for the tests of files with several signatures."""

import jax
import numpy as np

import odmlq
from samples.decoder_model import Decoder, DecoderConfig

CONFIG = DecoderConfig(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, mlp_hidden=64, cache_length=16)


def decoder():
    """``(model, variables, prompts, steps)``: prefill batches and the decode steps after them."""
    model = Decoder(CONFIG)
    variables = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))
    rng = np.random.default_rng(0)
    prompts = [(rng.integers(0, 256, (2, 6)).astype(np.int32), *model.empty_cache(2)) for _ in range(3)]
    steps = []
    for tokens, *cache in prompts:
        _, *cache = model.apply(variables, tokens, *cache, method="prefill")
        steps.append((rng.integers(0, 256, (2, 1)).astype(np.int32), np.full((2,), 6, np.int32),
                      *(np.asarray(x) for x in cache)))
    return model, variables, prompts, steps


def signatures(model, prompts, steps):
    cache = model.cache_names()
    names = ["logits", *cache]
    return {"prefill": odmlq.Signature(method="prefill", rep_dataset=prompts, input_names=["tokens", *cache],
                                       output_names=names),
            "decode": odmlq.Signature(method="decode", rep_dataset=steps, input_names=["token", "position", *cache],
                                      output_names=names)}
