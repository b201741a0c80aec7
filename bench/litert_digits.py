"""LiteRT latency and size of the digits samples: float vs odmlq int8, side by side.

Each model is exported by odmlq (float, and full-integer int8), then invoked
in the LiteRT interpreter with XNNPACK, one thread, batch 1, interleaving the
models in rounds so that machine noise hits them alike. Prints a markdown
table: bytes, XNNPACK partitions, median microseconds per invoke and the
int8/float ratio.

Run: python bench/litert_digits.py [--rounds 30] [--invokes 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import odmlq
from samples.digits import batches, load_digits_splits, train

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _interpreter(tflite: bytes):
    return odmlq.litert.interpreter(tflite, num_threads=1)


def main(rounds: int, invokes: int) -> None:
    digits = load_digits_splits()
    rows = []
    for name in ("cnn", "mlp"):
        model, variables = train(name, digits, seconds=20, max_steps=500)
        data = batches(digits.x_calibration, 32)
        files = {
            "float": odmlq.export_tflite(model, [], data, variables=variables, verify=False).tflite,
            "int8": odmlq.export_tflite(model, RULES, data, variables=variables).tflite,
        }
        interpreters = {k: _interpreter(v) for k, v in files.items()}
        x = digits.x_test[:1]
        times = {k: [] for k in files}
        for it in interpreters.values():
            it.set_tensor(it.get_input_details()[0]["index"], x)
            for _ in range(invokes):
                it.invoke()
        for _ in range(rounds):
            for key, it in interpreters.items():
                start = time.perf_counter()
                for _ in range(invokes):
                    it.invoke()
                times[key].append((time.perf_counter() - start) / invokes * 1e6)
        median = {k: statistics.median(v) for k, v in times.items()}
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
    parser.add_argument("--invokes", type=int, default=200)
    args = parser.parse_args()
    main(args.rounds, args.invokes)
