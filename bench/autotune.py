"""odmlq.autotune on the digits models: a size budget and an accuracy floor.

For each digits sample (trained 600 Adam steps, seed 0, as in
bench/accuracy.py), autotune runs twice, on the 180 calibration images:

- ``size``: at most 3 average bits per weight on XLA (candidates int2 / int4 /
  int8 weight-only and float), with the test accuracy at most 1 point under
  float's (eval_fn on the 540 test images);
- ``floor``: every output at least 45 dB SQNR on LiteRT (int8, int16x8 and
  float per module), the chosen rules exported, verified op by op, and the
  .tflite's accuracy measured in the LiteRT interpreter.

Printed per run: the trials (predicted and measured SQNR, bits per weight),
the chosen rules, the float and quantized test accuracy, and the seconds
autotune took.

Run:
  python bench/autotune.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import odmlq  # noqa: E402
from samples.digits import batches, load_digits_splits, train  # noqa: E402
from samples.digits_cnn import tflite_accuracy  # noqa: E402


def main() -> None:
    data = load_digits_splits()
    calibration = batches(data.x_calibration, 32)

    def accuracy(apply):
        return float(np.mean(np.argmax(np.asarray(apply(data.x_test)), -1) == data.y_test))

    rows = []
    for name in ("mlp", "cnn"):
        model, variables = train(name, data, seconds=1e9, max_steps=600, seed=0)
        start = time.perf_counter()
        size = odmlq.autotune(model, variables, calibration, backend="xla", eval_fn=accuracy,
                              target=odmlq.TuneTarget(max_bits_per_weight=3.0, max_metric_drop=0.01))
        size_seconds = time.perf_counter() - start
        print(f"## digits {name}: size budget\n{size}\n")
        start = time.perf_counter()
        floor = odmlq.autotune(model, variables, calibration, target=odmlq.TuneTarget(min_sqnr_db=45.0))
        floor_seconds = time.perf_counter() - start
        print(f"## digits {name}: accuracy floor\n{floor}\n")
        export = odmlq.export_tflite(model, floor.rules, calibration, variables=variables,
                                     allow_float_ops="float" in floor.choices.values())
        rows.append((name, size.float_metric, size.measured.metric, size.measured.bits_per_weight, size.met,
                     size_seconds, floor.measured.sqnr_db, tflite_accuracy(export.tflite, data.x_test, data.y_test),
                     len(export.tflite), floor.met, floor_seconds))
    print("| model | float acc | <= 3 bits/weight (XLA): acc | bits/weight | met | s | >= 45 dB (LiteRT): "
          "SQNR | .tflite acc | bytes | met | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| digits {r[0]} | {r[1]:.4f} | {r[2]:.4f} | {r[3]:.2f} | {r[4]} | {r[5]:.0f} | {r[6]:.1f} dB | "
              f"{r[7]:.4f} | {r[8]} | {r[9]} | {r[10]:.0f} |")


if __name__ == "__main__":
    main()
