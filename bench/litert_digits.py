"""LiteRT latency and size of the digits samples: float vs odmlq int8, side by side.

Each model is exported by odmlq (float; full-integer int8, the one-line rule
``odmlq.FULL_INTEGER_INT8``; and odmlq's default int8 rules ``odmlq.INT8``,
whose output op is a dynamic-range kernel writing float), then invoked in the
LiteRT interpreter with XNNPACK, one thread, batch 1, all files timed in the
same rounds (`odmlq.timing.interleaved_rounds`: each file follows every other
equally often). Prints a markdown table: bytes, XNNPACK partitions, median
microseconds per invoke and the ratio to float.

Run: python bench/litert_digits.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics

import odmlq
from odmlq.timing import interleaved_rounds
from samples.digits import batches, load_digits_splits, train


def _interpreter(tflite: bytes):
    return odmlq.litert.interpreter(tflite, num_threads=1)


def main(rounds: int) -> None:
    digits = load_digits_splits()
    rows = []
    for name in ("cnn", "mlp"):
        model, variables = train(name, digits, seconds=20, max_steps=500)
        data = batches(digits.x_calibration, 32)
        files = {
            "float": odmlq.export_tflite(model, [], data, variables=variables, verify=False).tflite,
            "int8, full integer": odmlq.export_tflite(model, odmlq.FULL_INTEGER_INT8, data, variables=variables,
                                                      benchmark=False).tflite,
            "int8 (odmlq.INT8)": odmlq.export_tflite(model, odmlq.INT8, data, variables=variables,
                                                     benchmark=False).tflite,
        }
        interpreters = {k: _interpreter(v) for k, v in files.items()}
        for it in interpreters.values():
            it.set_tensor(it.get_input_details()[0]["index"], digits.x_test[:1])
        times = interleaved_rounds([it.invoke for it in interpreters.values()], rounds=rounds)
        median = {k: statistics.median(t) * 1e3 for k, t in zip(interpreters, times)}
        for key, it in interpreters.items():
            partitions = [o["op_name"] for o in it._get_ops_details()].count("DELEGATE")
            rows.append((name, key, len(files[key]), partitions, median[key], median[key] / median["float"]))
    print("| model | weights | bytes | XNNPACK partitions | median us / invoke | vs float |")
    print("|---|---|---|---|---|---|")
    for name, key, size, partitions, us, ratio in rows:
        print(f"| {name} | {key} | {size:,} | {partitions} | {us:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    main(args.rounds)
