"""odmlq's int8 LiteRT export side by side with the peers', on the same weights and data.

Every tool makes a full-integer int8 .tflite (float inputs and outputs) of the
same float model, calibrated on the same inputs; each .tflite runs in the
LiteRT interpreter, one row per invoke, on the same held-out inputs, and is
scored by its output SQNR against the float JAX model (and the task metric
where there is one).

Tools:
- ``odmlq``: ``odmlq.export_tflite(model, odmlq.INT8, calibration)``, its
  default int8 rules and defaults: every edge int8, the op that writes the
  output (a matmul) a dynamic-range kernel reading its int8 input and writing
  float (``Rule.float_outputs``; same partitions, no float island).
- ``odmlq_full_integer``: ``odmlq.FULL_INTEGER_INT8`` (the one-line rule
  ``Rule('.*', weight_qtype='int8', act_qtype='int8')``): every op int8, the
  output too, as the peers make it.
- ``odmlq_out16``: the one-line rule with ``Rule('.*', writes_output=True,
  weight_qtype='int8', act_qtype='int16')`` first: the op that writes the
  output computes it in int16x8 (one op off XNNPACK), every other op int8.
- ``tflite_converter``: the TensorFlow Lite converter's post-training
  quantization (``Optimize.DEFAULT``, a representative dataset, int8 builtins)
  of a TensorFlow twin: the same layers written with ``tf.nn`` around the JAX
  model's weights (checked to match it before converting).
- ``litert_quantizer``: AI Edge Quantizer's ``static_wi8_ai8`` recipe (min/max)
  applied to the float .tflite of the same model (odmlq's float export).
- ``qwix``: Qwix's ODML path (statistics from its QAT provider, then its
  conversion provider's composites) converted by litert-converter.

Models (``bench/accuracy.py`` builds them, so the weights are those of its
table): ``digits_mlp``, ``digits_cnn`` (the samples, 600 Adam steps, seed 0;
calibration: the 180 calibration images; held out: the 540 test images) and
``mlp25m`` (1024-4096-4096-1024, Flax's init; 4096 calibration rows, 512 held
out).

The peers are installed in their own environment (see bench/peers/README.md);
odmlq never imports them.

Run:
  python bench/peers/run.py [--models digits_mlp,digits_cnn,mlp25m] [--tools odmlq,tflite_converter,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import odmlq  # noqa: E402
from accuracy import MODELS as BENCH_MODELS  # noqa: E402

INT8 = list(odmlq.FULL_INTEGER_INT8)
OUTPUTS_INT16 = odmlq.Rule(".*", writes_output=True, weight_qtype="int8", act_qtype="int16")
MODELS = ("digits_mlp", "digits_cnn", "mlp25m")

# The layers of each model, for its TensorFlow twin: (kind, module, relu after).
LAYERS = {
    "digits_mlp": [("flatten", None, False), ("dense", "dense1", True), ("dense", "dense2", True),
                   ("dense", "head", False)],
    "digits_cnn": [("conv", "conv1", True), ("avg_pool", None, False), ("conv", "conv2", True),
                   ("flatten", None, False), ("dense", "dense1", True), ("dense", "head", False)],
    "mlp25m": [("dense", "fc1", True), ("dense", "fc2", True), ("dense", "fc3", False)],
}


# --- inputs ------------------------------------------------------------------

def rows(batches) -> np.ndarray:
    """The first input of every batch, stacked: one array of rows."""
    return np.concatenate([np.asarray(b[0] if isinstance(b, tuple) else b) for b in batches])


def run_tflite(tflite: bytes, x: np.ndarray) -> np.ndarray:
    """Outputs of a .tflite, one row per invoke. A model with integer inputs
    and outputs (AI Edge Quantizer makes them) gets its inputs quantized and
    its outputs dequantized with the scales in its own tensors."""
    interpreter = odmlq.litert.interpreter(tflite, num_threads=1)
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    outputs = []
    for row in x[:, None]:
        if np.issubdtype(inp["dtype"], np.integer):
            scale, zero_point = inp["quantization"]
            info = np.iinfo(inp["dtype"])
            row = np.clip(np.round(row / scale) + zero_point, info.min, info.max)
        interpreter.set_tensor(inp["index"], row.astype(inp["dtype"]))
        interpreter.invoke()
        y = np.asarray(interpreter.get_tensor(out["index"]), np.float64)[0]
        if np.issubdtype(out["dtype"], np.integer):
            scale, zero_point = out["quantization"]
            y = (y - zero_point) * scale
        outputs.append(y)
    return np.stack(outputs)


def sqnr_db(reference: np.ndarray, value: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / max(np.sum((reference - value) ** 2), 1e-30)))


# --- the tools ---------------------------------------------------------------

def odmlq_int8(bench, rules=odmlq.INT8) -> bytes:
    return odmlq.export_tflite(bench.model, rules, bench.calibration, variables=bench.variables,
                               example_inputs=tuple(np.asarray(x)[:1] for x in bench.example),
                               progress=False).tflite


def odmlq_float(bench) -> bytes:
    return odmlq.export_tflite(bench.model, [], bench.calibration[:1], variables=bench.variables,
                               example_inputs=tuple(np.asarray(x)[:1] for x in bench.example),
                               verify=False, progress=False).tflite


def tensorflow_twin(name: str, bench):
    """A tf.Module computing the model with tf.nn ops around its weights."""
    import tensorflow as tf

    params = bench.variables["params"]

    class Twin(tf.Module):
        def __init__(self):
            super().__init__()
            self.weights_ = {m: (tf.Variable(np.asarray(params[m]["kernel"]), name=f"{m}_kernel"),
                                 tf.Variable(np.asarray(params[m]["bias"]), name=f"{m}_bias"))
                             for kind, m, _ in LAYERS[name] if m is not None}

        @tf.function
        def __call__(self, x):
            for kind, module, relu in LAYERS[name]:
                if kind == "flatten":
                    x = tf.reshape(x, (tf.shape(x)[0], -1))
                elif kind == "avg_pool":
                    x = tf.nn.avg_pool2d(x, 2, 2, "VALID")
                elif kind == "conv":
                    kernel, bias = self.weights_[module]
                    x = tf.nn.conv2d(x, kernel, 1, "SAME") + bias
                else:
                    kernel, bias = self.weights_[module]
                    x = tf.matmul(x, kernel) + bias
                if relu:
                    x = tf.nn.relu(x)
            return x

    return Twin()


def tflite_converter(name: str, bench, reference_rows: np.ndarray, reference: np.ndarray) -> bytes:
    import tensorflow as tf

    twin = tensorflow_twin(name, bench)
    twin_out = twin(tf.constant(reference_rows[:16])).numpy()
    if sqnr_db(reference[:16], twin_out) < 100:  # float32 noise only, or the twin is not the model
        raise RuntimeError(f"the TensorFlow twin of {name} is not the model: "
                           f"{sqnr_db(reference[:16], twin_out):.1f} dB")
    shape = [1, *np.shape(bench.example[0])[1:]]
    function = twin.__call__.get_concrete_function(tf.TensorSpec(shape, tf.float32))
    converter = tf.lite.TFLiteConverter.from_concrete_functions([function], twin)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    calibration = rows(bench.calibration)
    converter.representative_dataset = lambda: ([row[None]] for row in calibration)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    return converter.convert()


def litert_quantizer(bench, float_tflite: bytes) -> bytes:
    from ai_edge_quantizer import quantizer, recipe

    interpreter = odmlq.litert.interpreter(float_tflite)
    (name,) = interpreter.get_signature_runner().get_input_details()
    qt = quantizer.Quantizer(bytearray(float_tflite), recipe.static_wi8_ai8())
    calibration = rows(bench.calibration)
    result = qt.calibrate({"serving_default": [{name: row[None]} for row in calibration]})
    # Its .tflite takes and gives int8 tensors (scales in them); run_tflite converts.
    return bytes(qt.quantize(result, enable_progress_report=False).quantized_model)


def qwix_litert(bench) -> bytes:
    """Qwix's ODML path: statistics from its QAT provider run over the
    calibration batches (per-batch min/max, averaged: its default), then
    `OdmlConversionProvider`'s composites converted by litert-converter
    (odmlq's call of it: strict QDQ mode; Qwix's documented converter,
    ai_edge_jax, is not published). `strict=False`: the models reshape with
    an array method, which Qwix does not intercept."""
    import jax
    import qwix

    from odmlq.litert._convert import convert

    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
    example = np.asarray(bench.example[0])[:1]
    calibrating = qwix.quantize_model(bench.model, qwix.OdmlQatProvider(rules, strict=False))
    params = bench.variables["params"]
    stats = calibrating.init(jax.random.key(0), example)["quant_stats"]
    for batch in bench.calibration:
        x = batch[0] if isinstance(batch, tuple) else batch
        _, updated = calibrating.apply({"params": params, "quant_stats": stats}, x, mutable=["quant_stats"])
        stats = updated["quant_stats"]
    converting = qwix.quantize_model(bench.model, qwix.OdmlConversionProvider(rules, params, stats, strict=False))
    return convert(lambda x: converting.apply({"params": params}, x), (example,), input_names=["x"],
                   output_names=["output_0"])


TOOLS = ("odmlq", "odmlq_full_integer", "odmlq_out16", "tflite_converter", "litert_quantizer", "qwix")


# --- the table ---------------------------------------------------------------

def measure(name: str, tools) -> list[dict]:
    bench = BENCH_MODELS[name]()
    held_out = rows(bench.held_out)
    reference = np.concatenate([np.asarray(bench.model.apply(bench.variables, *x), np.float64)
                                for x in bench.held_out])
    float_tflite = odmlq_float(bench)
    results = []
    for tool in tools:
        start = time.perf_counter()
        if tool == "odmlq":
            tflite = odmlq_int8(bench)
        elif tool == "odmlq_full_integer":
            tflite = odmlq_int8(bench, INT8)
        elif tool == "odmlq_out16":
            tflite = odmlq_int8(bench, [OUTPUTS_INT16, *INT8])
        elif tool == "tflite_converter":
            tflite = tflite_converter(name, bench, held_out, reference)
        elif tool == "litert_quantizer":
            tflite = litert_quantizer(bench, float_tflite)
        else:
            tflite = qwix_litert(bench)
        seconds = time.perf_counter() - start
        summary = odmlq.litert.inspect(tflite)
        outputs = run_tflite(tflite, held_out)
        row = {"model": name, "tool": tool, "sqnr_db": sqnr_db(reference, outputs), "bytes": len(tflite),
               "float_islands": len(summary.float_islands), "dynamic_kernels": len(summary.dynamic_kernels),
               "seconds": seconds}
        if bench.metric is not None:
            row["metric"] = bench.metric[1](outputs, reference)
        results.append(row)
        print(f"# {name} {tool}: {row['sqnr_db']:.2f} dB in {seconds:.1f} s", file=sys.stderr, flush=True)
    return results


def table(results: list[dict]) -> str:
    header = ("model", "tool", "output SQNR dB", "test accuracy", "file bytes", "float islands",
              "dynamic-range kernels", "seconds")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        metric = f"{r['metric']:.4f}" if "metric" in r else "-"
        lines.append(f"| {r['model']} | {r['tool']} | {r['sqnr_db']:.2f} | {metric} | {r['bytes']:,} | "
                     f"{r['float_islands']} | {r['dynamic_kernels']} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, from " + ", ".join(TOOLS))
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    tools = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(tools) - set(TOOLS))
    if unknown:
        parser.error(f"unknown model(s) or tool(s) {unknown}")
    with tempfile.TemporaryDirectory():
        results = [r for m in models for r in measure(m, tools)]
    print(table(results))


if __name__ == "__main__":
    main()
