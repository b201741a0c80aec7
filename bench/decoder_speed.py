"""Decode tokens per second of the decoder (`samples.decoder_model`): LiteRT and XLA, quantized against float.

One decode step (one byte at position 64 of a 256-position cache, batch 1)
at two sizes: the sample's trained decoder (3.2M parameters: its weights
stay in this CPU's cache) and a serving-size one (about 38M parameters,
random weights, 150 MB in float32: a step reads every weight from memory,
not from this CPU's 32 MiB cache). For each:

- LiteRT, 1 thread, XNNPACK: the ``decode`` method exported alone (the same
  ops as the decode signature of `samples.decoder_tflite`'s files) as float,
  int8 dynamic-range and int4 blockwise dynamic-range (blocks of 32; the tied
  embedding int8), all timed in the same interleaved rounds
  (`odmlq.litert.interleaved_latency`);
- LiteRT, through the signature runner (the cache copied in and out): the
  full-integer prefill + decode file with its cache float and int8
  (``state_dtype='int8'``) against the float file;
- XLA CPU, jitted: float against int8 and int4 blockwise weight-only `ptq`,
  and int8 weight-only with the KV cache int8 between steps (QArrays, the
  sample's `KV_CACHE_RULE`), in interleaved rounds.

Speed does not depend on the weights' values: the weights are rounded to
nearest (no calibration data) and the files are not verified here (the
sample verifies the same schemas op by op).

Run: ``python bench/decoder_speed.py [--sizes sample,serving] [--checkpoint out/decoder.safetensors]``
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import odmlq  # noqa: E402
from samples.decoder_model import Decoder, DecoderConfig  # noqa: E402
from samples.decoder_tflite import KV_CACHE_RULE, decode_inputs, xla_decode_ms  # noqa: E402

R = odmlq.Rule
SIZES = {
    "sample": DecoderConfig(),
    "serving": DecoderConfig(hidden=768, layers=6, heads=12, kv_heads=4, head_dim=64, mlp_hidden=2048),
}
NEAREST = odmlq.Nearest()
LITERT = {
    "float": [],
    "int8 dynamic": [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True, weight_algorithm=NEAREST)],
    "int4 blockwise dynamic": [
        R("embedding.*", weight_qtype="int8", act_qtype="int8", act_dynamic=True, weight_algorithm=NEAREST),
        R(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32), act_qtype="int8", act_dynamic=True,
          weight_algorithm=NEAREST)],
}
XLA = {
    "int8 weight-only": [R(".*", op="dot_general", weight_qtype="int8", weight_algorithm=NEAREST),
                         R("embedding", weight_qtype="int8", weight_algorithm=NEAREST)],
    "int4 blockwise weight-only": [
        R("embedding.*", weight_qtype="int8", weight_algorithm=NEAREST),
        R(".*", op="dot_general", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32),
          weight_algorithm=NEAREST)],
}


def _kv_cache_step(model, variables, inputs):
    """The int8 weight-only step with its KV cache int8 between steps (`state`): calibrated on
    a few steps after a random prompt, and timed fed the QArray cache its own first step returns
    (in place of the float cache `inputs` carry)."""
    rng = np.random.default_rng(0)
    _, *cache = model.apply(variables, rng.integers(0, 256, (1, 64)).astype(np.int32), *model.empty_cache(1),
                            method="prefill")
    steps = []
    for position in range(64, 68):
        steps.append((rng.integers(0, 256, (1, 1)).astype(np.int32), np.array([position], np.int32),
                      *(np.asarray(x) for x in cache)))
        _, *cache = model.apply(variables, *steps[-1], method="decode")
    rules = [KV_CACHE_RULE, *XLA["int8 weight-only"]]
    plan = odmlq.plan(model, rules, *inputs, variables=variables, method="decode", target="xla",
                      state=model.decode_state())
    qmodel = odmlq.ptq(model, plan, variables, odmlq.calibrate(model, plan, steps, variables=variables,
                                                                 progress=False))
    jitted, params = jax.jit(qmodel.apply), jax.device_put(qmodel.params)
    cache = jitted(params, *inputs)[1:]
    return lambda token, position, *_: jitted(params, token, position, *cache)


def _full_integer_caches(model, variables, inputs) -> list[tuple]:
    """The full-integer prefill + decode file with its cache float and int8 (`state_dtype`),
    and the float file: a decode call through each file's signature runner, the cache copied
    in and out as an app's loop does, in the same interleaved rounds. Full integer needs
    calibration: the sample's (prompts of Python's docs and the decode steps after them)."""
    from samples.decoder_lm import corpus
    from samples.decoder_tflite import SCHEMAS, _signature_ms, _signatures, calibration

    signatures = _signatures(model, *calibration(model, variables, corpus()[0]))
    files = {"float": odmlq.export_signatures(model, [], signatures, variables=variables, verify=False,
                                              progress=False).tflite}
    for state in ("float", "int8"):
        files[f"int8 full integer, {state} cache"] = odmlq.export_signatures(
            model, SCHEMAS["int8 full integer"], signatures, variables=variables, verify=False, progress=False,
            state_dtype=state).tflite
    ms = dict(zip(files, _signature_ms([(f, "decode") for f in files.values()], inputs, model.cache_names(),
                                       rounds=11, calls=10)))
    return [(schema, len(files[schema]), ms[schema], ms["float"] / ms[schema]) for schema in files]


def measure(name: str, model, variables) -> list[dict]:
    inputs = decode_inputs(model)
    files = {schema: odmlq.export_tflite(model, rules, [inputs], variables=variables, method="decode",
                                         verify=False, benchmark=False, progress=False).tflite for schema, rules in LITERT.items()}
    litert_ms = dict(zip(files, odmlq.litert.interleaved_latency(list(files.values()), inputs, rounds=15,
                                                                 invokes=20)))
    float_step = jax.jit(lambda *x: model.apply(variables, *x, method="decode"))
    steps = {"float": float_step}
    for schema, rules in XLA.items():
        qmodel = odmlq.ptq(model, rules, variables, example_inputs=inputs, method="decode", target="xla")
        jitted = jax.jit(qmodel.apply)
        steps[schema] = (lambda f, p: (lambda *x: f(p, *x)))(jitted, qmodel.params)
    steps["int8 weight-only, int8 KV cache"] = _kv_cache_step(model, variables, inputs)
    xla_ms = dict(zip(steps, xla_decode_ms(list(steps.values()), inputs)))
    parameters = sum(np.size(x) for x in jax.tree.leaves(variables))
    rows = [{"size": f"{name} ({parameters / 1e6:.1f}M)", "backend": "LiteRT 1 thread", "schema": schema,
             "bytes": len(files[schema]), "ms": ms, "speedup": litert_ms["float"] / ms}
            for schema, ms in litert_ms.items()]
    rows += [{"size": f"{name} ({parameters / 1e6:.1f}M)", "backend": "LiteRT 1 thread, signature runner",
              "schema": schema, "bytes": size, "ms": ms, "speedup": speedup}
             for schema, size, ms, speedup in _full_integer_caches(model, variables, inputs)]
    rows += [{"size": f"{name} ({parameters / 1e6:.1f}M)", "backend": "XLA CPU", "schema": schema, "bytes": None,
              "ms": ms, "speedup": xla_ms["float"] / ms} for schema, ms in xla_ms.items()]
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="sample,serving")
    parser.add_argument("--checkpoint", help="the sample's trained decoder (default: random weights)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.sizes.split(","):
        if name == "sample" and args.checkpoint:
            from converters.decoder import load_decoder

            model, variables, _ = load_decoder(args.checkpoint)
        else:
            model = Decoder(SIZES[name])
            variables = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))
        measured = measure(name, model, variables)
        if not rows:
            print("| model | backend | schema | file bytes | ms per decode step | tokens/s vs float |")
            print("|---|---|---|---|---|---|")
        for r in measured:
            size = "" if r["bytes"] is None else f"{r['bytes']:,}"
            print(f"| {r['size']} | {r['backend']} | {r['schema']} | {size} | {r['ms']:.3f} | {r['speedup']:.2f}x |",
                  flush=True)
        rows += measured
    return rows


if __name__ == "__main__":
    main()
