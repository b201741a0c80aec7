"""The trained decoder to LiteRT with a KV cache (prefill and decode signatures) and to XLA, verified.

Reads the checkpoint `samples.decoder_lm` writes (``python -m samples.decoder_lm``),
and for each schema (`SCHEMAS`):

- exports one .tflite with a ``prefill`` signature (a `PROMPT`-byte prompt,
  the cache in and out) and a ``decode`` signature (one byte at a position,
  the cache in and out), the weights stored once and every op verified
  against `odmlq.simulate` (`odmlq.export_signatures`);
- greedy-decodes `GENERATED` bytes after each of `PROMPTS` prompts (cut
  from the held-out topics) three ways: the .tflite in LiteRT's
  interpreter, `simulate` of the same plans and scales, and `odmlq.ptq` on
  XLA (the same rules and calibration), and counts where they differ;
- measures perplexity per byte on the held-out topics (windows of
  `PROMPT` bytes, the prefill signature's logits) for the float model,
  simulate, XLA and the .tflite;
- times one decode step on LiteRT (1 thread, XNNPACK, interleaved with the
  float file) and, jitted, on XLA.

Calibration: prompts cut from the training topics (prefill), and the
decode steps that follow them in the float model (the cache as the float
model fills it). The first signature's data rounds the weights (GPTQ, the
default where data reaches a weight), so prefill and decode share them.

Run it: ``python -m samples.decoder_tflite [--checkpoint PATH] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import math
import os

import jax
import numpy as np

import odmlq
from odmlq.timing import interleaved_ms
from samples.decoder_lm import corpus

PROMPT, GENERATED, PROMPTS = 64, 64, 10
CALIBRATION_PROMPTS, DECODE_STEPS = 16, 4
R = odmlq.Rule
SCHEMAS: dict[str, list] = {
    # Hybrid kernels: int8 weights, each matmul's input quantized per row at run time.
    "int8 dynamic": [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
    # Full integer: int8 activations at calibrated scales too (the cache crosses the
    # signature as float, quantized at each one's own scale), what an NPU runs.
    "int8 full integer": [R(".*", weight_qtype="int8", act_qtype="int8")],
    # The same, the cache crossing both signatures as int8 codes on one scale per tensor
    # (`STATE_DTYPE`): the app keeps it in int8, and no step converts the whole cache.
    "int8 full integer, int8 cache": [R(".*", weight_qtype="int8", act_qtype="int8")],
    # int4 in blocks of 32 on XNNPACK's blockwise kernel; the tied embedding (also the
    # table every token is looked up in) stays int8 per channel.
    "int4 blockwise dynamic": [
        R("embedding.*", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
        R(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32), act_qtype="int8", act_dynamic=True)],
    # The same, each block's range first searched against the calibration inputs (AWQ's
    # clip search), then GPTQ.
    "int4 blockwise dynamic, clip search": [
        R("embedding.*", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
        R(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32), act_qtype="int8", act_dynamic=True,
          weight_algorithm=odmlq.GPTQ(clip_search=True))],
    # The same, each block rounded to nearest instead of by GPTQ: what GPTQ buys.
    "int4 blockwise dynamic, to nearest": [
        R("embedding.*", weight_qtype="int8", act_qtype="int8", act_dynamic=True, weight_algorithm=odmlq.Nearest()),
        R(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32), act_qtype="int8", act_dynamic=True,
          weight_algorithm=odmlq.Nearest())],
}
STATE_DTYPE = {"int8 full integer, int8 cache": "int8"}
# XLA serving: weights alone quantized (a decode step is memory-bound: int8 weights move a
# quarter of float's bytes), the activations float.
XLA_WEIGHT_ONLY: dict[str, list] = {
    "XLA int8 weight-only": [R(".*", op="dot_general", weight_qtype="int8"), R("embedding", weight_qtype="int8")],
    "XLA int4 blockwise weight-only": [
        R("embedding.*", weight_qtype="int8"),
        R(".*", op="dot_general", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32))],
    "XLA int4 blockwise weight-only, to nearest": [
        R("embedding.*", weight_qtype="int8", weight_algorithm=odmlq.Nearest()),
        R(".*", op="dot_general", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32),
          weight_algorithm=odmlq.Nearest())],
}
# XLA serving with the KV cache int8 between decode steps (`Decoder.decode_state`): the select
# that writes each layer's keys and values (and so the cache it reads back) quantized, one
# scale per head-dim channel; the cache crosses calls as QArrays, a quarter of float's bytes.
KV_CACHE_RULE = R(".*attention", op="select_n", writes_output=True, act_qtype="int8",
                  act_granularity=odmlq.PerChannel(3))
XLA_KV_CACHE: dict[str, list] = {
    "XLA int8 weight-only, int8 KV cache": [KV_CACHE_RULE, *XLA_WEIGHT_ONLY["XLA int8 weight-only"]],
}


def names(model) -> dict:
    """Each signature's input and output names: the cache as `Decoder.cache_names`."""
    cache = model.cache_names()
    return {"prefill": (["tokens", *cache], ["logits", *cache]),
            "decode": (["token", "position", *cache], ["logits", *cache])}


def prompts(text: np.ndarray, count: int, length: int = PROMPT, seed: int = 0) -> np.ndarray:
    """`count` windows of `length` bytes at random places of `text`, ``(count, length)`` int32."""
    starts = np.random.default_rng(seed).integers(0, len(text) - length, count)
    return np.stack([text[s:s + length] for s in starts]).astype(np.int32)


def calibration(model, variables, training: np.ndarray):
    """``(prefill batches, decode batches)``: prompts from the training text, and the
    decode steps after them with the cache the float model fills."""
    batch = prompts(training, CALIBRATION_PROMPTS, seed=1)
    prefill, decode = [], []
    for rows in np.split(batch, 4):
        cache = model.empty_cache(len(rows))
        prefill.append((rows, *cache))
        logits, *cache = model.apply(variables, rows, *cache, method="prefill")
        token = np.argmax(np.asarray(logits)[:, -1:], axis=-1).astype(np.int32)
        for step in range(DECODE_STEPS):
            position = np.full((len(rows),), PROMPT + step, np.int32)
            decode.append((token, position, *(np.asarray(x) for x in cache)))
            logits, *cache = model.apply(variables, token, position, *cache, method="decode")
            token = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
    return prefill, decode


def greedy(prefill, decode, prompt: np.ndarray, empty_cache, steps: int = GENERATED) -> np.ndarray:
    """`steps` greedy bytes after `prompt` ``(1, PROMPT)``: ``prefill(tokens, *cache)``
    and ``decode(token, position, *cache)`` return ``(logits, *cache)``."""
    logits, *cache = prefill(prompt, *empty_cache(1))
    token = np.argmax(np.asarray(logits)[:, -1:], axis=-1).astype(np.int32)
    out = []
    for step in range(steps):
        out.append(int(token[0, 0]))
        logits, *cache = decode(token, np.array([prompt.shape[1] + step], np.int32), *cache)
        token = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
    return np.asarray(out, np.int32)


def perplexity(prefill, empty_cache, text: np.ndarray, length: int = PROMPT) -> float:
    """Per-byte perplexity from the prefill logits of consecutive windows (one at a time)."""
    total, count = 0.0, 0
    for start in range(0, len(text) - length - 1, length):
        window = text[start:start + length + 1].astype(np.int32)
        logits = np.asarray(prefill(window[None, :-1], *empty_cache(1))[0], np.float64)[0]
        logits -= logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        total -= float(np.sum(log_probs[np.arange(length), window[1:]]))
        count += length
    return math.exp(total / count)


def _litert(tflite: bytes, cache_names: list[str]):
    runner = odmlq.litert.interpreter(tflite, num_threads=1)
    prefill, decode = runner.get_signature_runner("prefill"), runner.get_signature_runner("decode")
    details = prefill.get_input_details()

    def outputs(out):
        return out["logits"], *(out[name] for name in cache_names)

    def cache_feed(cache):  # a float cache (the first call's) given to an int8-cache file: its codes
        feed = {}
        for name, x in zip(cache_names, cache):
            x, d = np.asarray(x), details[name]
            if d["dtype"] == np.int8 and x.dtype.kind == "f":
                scale, zero = d["quantization"]
                x = np.clip(np.round(x / scale) + zero, -128, 127).astype(np.int8)
            feed[name] = x
        return feed

    def run_prefill(tokens, *cache):
        return outputs(prefill(tokens=tokens, **cache_feed(cache)))

    def run_decode(token, position, *cache):
        return outputs(decode(token=token, position=position, **cache_feed(cache)))

    return run_prefill, run_decode


def decode_inputs(model, position: int = PROMPT) -> tuple:
    """One decode step's inputs: a byte at `position` of an empty cache."""
    return (np.array([[65]], np.int32), np.array([position], np.int32), *model.empty_cache(1))


def xla_decode_ms(steps: list, inputs: tuple, rounds: int = 15, calls: int = 20) -> list[float]:
    """Median ms per call of each jitted decode step, timed in the same interleaved rounds."""
    return interleaved_ms([lambda step=step: step(*inputs) for step in steps], rounds=rounds, repeats=calls)


def main(checkpoint: str = "out/decoder.safetensors", out_dir: str = "out", schemas=tuple(SCHEMAS),
         held_out_bytes: int | None = 8192) -> dict:
    from converters.decoder import load_decoder

    os.makedirs(out_dir, exist_ok=True)
    model, variables, config = load_decoder(checkpoint)
    training, held_out = corpus()
    held_out = held_out[:held_out_bytes]
    prefill_data, decode_data = calibration(model, variables, training)
    tests = prompts(held_out, PROMPTS, seed=2)

    def float_prefill(t, *cache):
        return model.apply(variables, t, *cache, method="prefill")

    def float_decode(t, p, *cache):
        return model.apply(variables, t, p, *cache, method="decode")

    jit_prefill, jit_decode = jax.jit(float_prefill), jax.jit(float_decode)
    results = {"float": {"perplexity": perplexity(jit_prefill, model.empty_cache, held_out),
                         "tokens": [greedy(jit_prefill, jit_decode, p[None], model.empty_cache) for p in tests]}}
    float_export = odmlq.export_signatures(model, [], _signatures(model, prefill_data, decode_data), variables=variables,
                                           verify=False, progress=False)
    results["float"]["bytes"] = len(float_export.tflite)
    float_decode_file = float_export.signatures["decode"].tflite
    for schema in schemas:
        results[schema] = _schema(schema, model, variables, prefill_data, decode_data, tests, held_out, out_dir,
                                  float_decode_file, jit_decode)
    for name, rules in XLA_WEIGHT_ONLY.items():
        results[name] = _weight_only(rules, model, variables, prefill_data, held_out, jit_decode)
    for name, rules in XLA_KV_CACHE.items():
        results[name] = _kv_cache(rules, model, variables, prefill_data, decode_data, tests, held_out, jit_prefill,
                                  jit_decode, results["float"]["tokens"])
    results["text"] = {"prompt": bytes(tests[0].astype(np.uint8)).decode("utf-8", "replace"),
                       "float": bytes(results["float"]["tokens"][0].astype(np.uint8)).decode("utf-8", "replace")}
    for schema in schemas:
        results["text"][schema] = bytes(results[schema]["litert"]["tokens"][0].astype(np.uint8)).decode(
            "utf-8", "replace")
    _print(results, config)
    return results


def _signatures(model, prefill_data, decode_data) -> dict:
    named = names(model)
    return {name: odmlq.Signature(method=name, rep_dataset=data, input_names=named[name][0],
                                  output_names=named[name][1])
            for name, data in (("prefill", prefill_data), ("decode", decode_data))}


def _schema(schema, model, variables, prefill_data, decode_data, tests, held_out, out_dir, float_decode_file,
            float_xla_decode) -> dict:
    rules = SCHEMAS[schema]
    path = os.path.join(out_dir, f"decoder_{schema.replace(' ', '_')}.tflite")
    exported = odmlq.export_signatures(model, rules, _signatures(model, prefill_data, decode_data), path,
                                       variables=variables, progress=False,
                                       state_dtype=STATE_DTYPE.get(schema, "float"))
    single = exported.signatures
    simulated = {name: odmlq.Simulator(model, single[name].plan, single[name].scales, variables=variables)
                 for name in single}
    litert_prefill, litert_decode = _litert(exported.tflite, model.cache_names())
    # XLA: the same plans and calibration; decode reads the params prefill quantized.
    xla_prefill = odmlq.ptq(model, single["prefill"].plan, variables, single["prefill"].calibration)
    xla_decode = odmlq.ptq(model, single["decode"].plan, xla_prefill.params, single["decode"].calibration)
    runs = {"litert": (litert_prefill, litert_decode),
            "simulate": (simulated["prefill"], simulated["decode"]),
            "xla": (xla_prefill, xla_decode)}
    row = {"bytes": len(exported.tflite), "path": path,
           "partitions": {name: single[name].delegation.partitions for name in single}}
    for run, (prefill, decode) in runs.items():
        row[run] = {"tokens": [greedy(prefill, decode, p[None], model.empty_cache) for p in tests],
                    "perplexity": perplexity(prefill, model.empty_cache, held_out)}
    for first, second in (("litert", "simulate"), ("litert", "xla"), ("simulate", "xla")):
        # Per prompt: how many bytes agree before the first that differs (GENERATED: all of them).
        row[f"{first}_vs_{second}"] = [int(np.argmax(a != b)) if np.any(a != b) else GENERATED
                                       for a, b in zip(row[first]["tokens"], row[second]["tokens"])]
    # Each decode signature alone (the same ops as in the combined file), float and quantized
    # in the same interleaved rounds, one thread.
    inputs = decode_inputs(model)
    row["litert_ms"], row["float_litert_ms"] = odmlq.litert.interleaved_latency(
        [single["decode"].tflite, float_decode_file], inputs, rounds=15, invokes=50)
    xla_step = jax.jit(xla_decode.apply)
    row["xla_ms"], row["float_xla_ms"] = xla_decode_ms(
        [lambda *x: xla_step(xla_decode.params, *x), float_xla_decode], inputs)
    if schema in STATE_DTYPE:  # the combined file's decode (int8 cache) against the float-cache one
        runs = [(exported.tflite, "decode"), (single["decode"].tflite, None), (float_decode_file, None)]
        row["state_ms"], row["float_state_ms"], row["float_file_ms"] = _signature_ms(runs, inputs, model.cache_names())
        row["litert_cache_bytes"] = sum(np.asarray(x).nbytes for x in litert_decode(*inputs)[1:])
    return row


def _signature_ms(runs, inputs, cache_names, rounds: int = 15, calls: int = 50) -> list[float]:
    """Median ms per decode call through each file's signature runner (`None`: its
    only one), its cache inputs in the dtype the file takes, in interleaved rounds."""
    calls_of = []
    for tflite, key in runs:
        runner = odmlq.litert.interpreter(tflite, num_threads=1).get_signature_runner(key)
        details = runner.get_input_details()
        feed = {"token": inputs[0], "position": inputs[1],
                **{n: np.asarray(x).astype(details[n]["dtype"]) for n, x in zip(cache_names, inputs[2:])}}
        calls_of.append(lambda runner=runner, feed=feed: runner(**feed))
    return interleaved_ms(calls_of, rounds=rounds, repeats=calls)


def _weight_only(rules, model, variables, prefill_data, held_out, float_xla_decode) -> dict:
    """XLA serving with weights alone quantized (GPTQ against the prefill data): perplexity
    and the decode step against float's, in the same interleaved rounds."""
    prompt = prefill_data[0]
    plan = odmlq.plan(model, rules, *prompt, variables=variables, method="prefill", target="xla")
    calibration = odmlq.calibrate(model, plan, prefill_data, variables=variables, progress=False)
    prefill = odmlq.ptq(model, plan, variables, calibration)
    decode = odmlq.ptq(model, rules, prefill.params, example_inputs=decode_inputs(model), method="decode",
                       target="xla")
    step = jax.jit(decode.apply)
    ms, float_ms = xla_decode_ms([lambda *x: step(decode.params, *x), float_xla_decode], decode_inputs(model))
    return {"perplexity": perplexity(prefill, model.empty_cache, held_out), "xla_ms": ms, "float_xla_ms": float_ms,
            "bytes": sum(getattr(q, "nbytes", np.size(q) * 4) for q in jax.tree.leaves(
                prefill.params, is_leaf=lambda q: isinstance(q, odmlq.QArray)))}


def decode_perplexity(prefill, decode, empty_cache, text: np.ndarray, length: int = PROMPT,
                      first: int = 8) -> float:
    """Per-byte perplexity through the cache: each window's first `first` bytes
    prefilled, then one decode step per byte (the true byte fed back), so every
    logit after the first reads keys and values the decode steps wrote."""
    total, count = 0.0, 0
    for start in range(0, len(text) - length - 1, length):
        window = text[start:start + length + 1].astype(np.int32)
        logits, *cache = prefill(window[None, :first], *empty_cache(1))
        rows = [np.asarray(logits)[0, -1]]
        for i in range(first, length):
            logits, *cache = decode(window[None, i:i + 1], np.array([i], np.int32), *cache)
            rows.append(np.asarray(logits)[0, -1])
        logits = np.asarray(rows, np.float64)
        logits -= logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        total -= float(np.sum(log_probs[np.arange(len(rows)), window[first:length + 1]]))
        count += len(rows)
    return math.exp(total / count)


def _kv_cache(rules, model, variables, prefill_data, decode_data, tests, held_out, float_prefill, float_decode,
              float_tokens) -> dict:
    """XLA decode with the cache int8 between steps (QArrays), after a float prefill:
    perplexity through the cache against float's and the weights alone quantized,
    greedy bytes against the weights-alone run's and float's, cache bytes, the step's time
    (`tests/xla/test_state.py` checks the int8 cache against simulate)."""
    state = model.decode_state()
    plan = odmlq.plan(model, rules, *decode_data[0], variables=variables, method="decode", target="xla",
                      state=state)
    calibration = odmlq.calibrate(model, plan, decode_data, variables=variables, progress=False)
    decode = odmlq.ptq(model, plan, variables, calibration)
    weights_only = odmlq.ptq(model, [r for r in rules if r is not KV_CACHE_RULE], decode.params,
                             example_inputs=decode_inputs(model), method="decode", target="xla")
    step, plain = jax.jit(decode.apply), jax.jit(weights_only.apply)
    params, plain_params = jax.device_put(decode.params), jax.device_put(weights_only.params)
    runs = {"kv": lambda *x: step(params, *x), "weights": lambda *x: plain(plain_params, *x)}
    row = {name: decode_perplexity(float_prefill, run, model.empty_cache, held_out) for name, run in runs.items()}
    row["float"] = decode_perplexity(float_prefill, float_decode, model.empty_cache, held_out)
    row["tokens"] = [greedy(float_prefill, runs["kv"], p[None], model.empty_cache) for p in tests]
    weights_tokens = [greedy(float_prefill, runs["weights"], p[None], model.empty_cache) for p in tests]
    row["same_as_weights"] = sum(np.array_equal(a, b) for a, b in zip(row["tokens"], weights_tokens))
    row["same_as_float"] = sum(np.array_equal(a, b) for a, b in zip(row["tokens"], float_tokens))
    inputs = decode_inputs(model)
    cache = runs["kv"](*inputs)[1:]
    row["cache_bytes"] = sum(q.nbytes for q in cache)
    row["float_cache_bytes"] = sum(np.asarray(x).nbytes for x in inputs[2:])
    stepped = (inputs[0], inputs[1], *cache)
    row["xla_ms"], row["weights_ms"], row["float_xla_ms"] = interleaved_ms(
        [lambda: jax.block_until_ready(runs["kv"](*stepped)), lambda: jax.block_until_ready(runs["weights"](*inputs)),
         lambda: jax.block_until_ready(float_decode(*inputs))], rounds=15, repeats=20)
    return row


def _print(results: dict, config) -> None:
    flt = results["float"]
    print(f"decoder: {config.layers} layers, hidden {config.hidden}, {config.heads} heads / {config.kv_heads} KV "
          f"heads, cache {config.cache_length}; {PROMPTS} prompts of {PROMPT} bytes, {GENERATED} generated each")
    print(f"float: held-out perplexity {flt['perplexity']:.4f} per byte; .tflite {flt['bytes']:,} bytes")
    for schema, row in results.items():
        if schema in ("float", "text"):
            continue
        if "kv" in row:  # XLA, int8 KV cache
            print(f"{schema}: perplexity through the cache {row['kv']:.4f} ({100 * (row['kv'] / row['float'] - 1):+.2f}% "
                  f"vs float's {row['float']:.4f}; weights alone int8 {row['weights']:.4f}); cache "
                  f"{row['cache_bytes']:,} bytes vs {row['float_cache_bytes']:,}; greedy bytes = weights alone int8 on "
                  f"{row['same_as_weights']} / {PROMPTS}, = float on {row['same_as_float']} / {PROMPTS}; decode step "
                  f"{row['xla_ms']:.3f} ms vs {row['weights_ms']:.3f} ms (weights alone) and {row['float_xla_ms']:.3f} "
                  f"ms float ({row['float_xla_ms'] / row['xla_ms']:.2f}x float's tokens/s)")
            continue
        change = 100 * (row.get("litert", row)["perplexity"] / flt["perplexity"] - 1)
        if "litert" not in row:  # XLA weight-only
            print(f"{schema}: perplexity {row['perplexity']:.4f} ({change:+.2f}%), weights {row['bytes']:,} bytes; "
                  f"decode step {row['xla_ms']:.3f} ms vs float {row['float_xla_ms']:.3f} ms "
                  f"({row['float_xla_ms'] / row['xla_ms']:.2f}x float's tokens/s)")
            continue
        pairs = ("litert_vs_simulate", "litert_vs_xla", "simulate_vs_xla")
        same = {pair: sum(n == GENERATED for n in row[pair]) for pair in pairs}
        differ = [f"{pair.replace('_vs_', ' = ')} {row[pair]}" for pair in pairs if same[pair] < PROMPTS]
        print(f"{schema}: {row['bytes']:,} bytes, XNNPACK partitions {row['partitions']}; prompts whose {GENERATED} "
              f"greedy bytes are the same: " + ", ".join(
                  f"{pair.replace('_vs_', ' = ')} {same[pair]} / {PROMPTS}" for pair in pairs)
              + (f" (bytes before a difference: {', '.join(differ)})" if differ else ""))
        print("  perplexity: " + ", ".join(
            f"{run} {row[run]['perplexity']:.4f} ({100 * (row[run]['perplexity'] / flt['perplexity'] - 1):+.2f}%)"
            for run in ("simulate", "xla", "litert")))
        if "state_ms" in row:
            print(f"  decode through the signature runner, the cache int8 ({row['litert_cache_bytes']:,} bytes): "
                  f"{row['state_ms']:.3f} ms vs {row['float_state_ms']:.3f} ms with it float (int8 full integer) and "
                  f"{row['float_file_ms']:.3f} ms for the float file ({row['float_file_ms'] / row['state_ms']:.2f}x)")
        print(f"  decode step, LiteRT 1 thread: {row['litert_ms']:.3f} ms vs float {row['float_litert_ms']:.3f} ms "
              f"({row['float_litert_ms'] / row['litert_ms']:.2f}x float's tokens/s); XLA (same rules) "
              f"{row['xla_ms']:.3f} ms vs {row['float_xla_ms']:.3f} ms")
    text = results["text"]
    print(f"\nprompt: {text['prompt']!r}")
    for name, generated in text.items():
        if name != "prompt":
            print(f"  {name + ':':<40} {generated!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="out/decoder.safetensors")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    main(args.checkpoint, args.out)
