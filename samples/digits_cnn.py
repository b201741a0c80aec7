"""The main job: a small CNN trained on digits, exported to full-integer int8 LiteRT.

Trains the Linen CNN of `samples.models` on scikit-learn's 8x8 digits for a
few seconds, exports a float .tflite (for reference) and a full-integer int8
.tflite (calibrated on held-apart calibration images, verified op by op
against odmlq's simulation), then runs both in the LiteRT interpreter on the
test images and prints accuracy, file sizes and the op lists.

Run it: ``odmlq demo`` or ``python -m samples.digits_cnn [--out DIR]``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import odmlq
from samples.digits import accuracy, batches, load_digits_splits, train

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def tflite_accuracy(tflite: bytes, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of a .tflite on (x, y), one image per invoke as on a phone."""
    interpreter = odmlq.litert.interpreter(tflite, num_threads=1)
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    correct = 0
    for image, label in zip(x, y):
        interpreter.set_tensor(inp["index"], image[None].astype(inp["dtype"]))
        interpreter.invoke()
        correct += int(np.argmax(interpreter.get_tensor(out["index"])) == label)
    return correct / len(y)


def main(out_dir: str = "out", seconds: float = 5.0) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    digits = load_digits_splits()
    start = time.perf_counter()
    model, variables = train("cnn", digits, seconds=seconds)
    print(f"trained the CNN for {time.perf_counter() - start:.1f} s "
          f"({len(digits.x_train)} images)")
    representative = batches(digits.x_calibration, 32)
    float_export = odmlq.export_tflite(model, [], representative,
                                       os.path.join(out_dir, "digits_cnn_float.tflite"),
                                       variables=variables, verify=False)
    start = time.perf_counter()
    int8_export = odmlq.export_tflite(model, RULES, representative,
                                      os.path.join(out_dir, "digits_cnn_int8.tflite"),
                                      variables=variables)
    print(f"exported int8 in {time.perf_counter() - start:.1f} s")
    results = {
        "float_jax": accuracy(model, variables, digits.x_test, digits.y_test),
        "float_tflite": tflite_accuracy(float_export.tflite, digits.x_test, digits.y_test),
        "int8_tflite": tflite_accuracy(int8_export.tflite, digits.x_test, digits.y_test),
        "float_bytes": len(float_export.tflite),
        "int8_bytes": len(int8_export.tflite),
    }
    print()
    print(int8_export.plan)
    print()
    print(int8_export.verification)
    print()
    print("ops (int8):  " + ", ".join(f"{k} x{v}" for k, v in int8_export.summary.op_histogram.items()))
    print("ops (float): " + ", ".join(f"{k} x{v}" for k, v in float_export.summary.op_histogram.items()))
    print("float islands (int8): " + (", ".join(o.name for o in int8_export.summary.float_islands) or "none"))
    for line in (int8_export.delegation, *int8_export.latencies):  # the export times small models against float
        print(f"int8 {line}")
    print()
    print(f"{'model':<14}{'test accuracy':>15}{'file bytes':>12}")
    print(f"{'float (JAX)':<14}{results['float_jax']:>15.4f}{'':>12}")
    print(f"{'float .tflite':<14}{results['float_tflite']:>15.4f}{results['float_bytes']:>12}")
    print(f"{'int8 .tflite':<14}{results['int8_tflite']:>15.4f}{results['int8_bytes']:>12}")
    print(f"int8 file is {100 * results['int8_bytes'] / results['float_bytes']:.1f}% of the float "
          f"file; written to {int8_export.path}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out", help="directory for the .tflite files")
    parser.add_argument("--seconds", type=float, default=5.0, help="training time budget")
    args = parser.parse_args()
    main(args.out, args.seconds)
