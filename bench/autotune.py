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

With ``--minilm`` (needs the minilm extra): all-MiniLM-L6-v2 tuned on LiteRT
for a mean cosine of 0.995 on the sample's 64 calibration sentences
(candidates: int8 with MSE ranges, as the sample's int8 schema, int16x8,
float), once without and once with a latency budget of 1x float (which
also gates placement: no group quantized where XNNPACK leaves its ops to
the reference kernels); then the chosen rules and the sample's hand-written
int8+int16 rules (`samples.minilm_tflite.SCHEMAS['int8+int16']`) each exported,
verified, and measured on the 227 held-out sentences: mean and minimum
cosine to float, paraphrase top-1, file size, and latency per sentence (1
thread) against float, all files timed in the same interleaved rounds.

Run:
  python bench/autotune.py [--minilm]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import odmlq  # noqa: E402
from samples.digits import batches, load_digits_splits, train  # noqa: E402
from samples.digits_cnn import tflite_accuracy  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", action="store_true", help="tune MiniLM instead of the digits models")
    if parser.parse_args(argv).minilm:
        minilm()
        return
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


def minilm() -> None:
    import jax

    from converters.minilm import load_minilm, tokenize
    from samples.minilm_tflite import (MASK_BIAS, PARAPHRASE_PAIRS, SCHEMAS, SEQ_LEN, load_sentences, retrieval,
                                       run_tflite)

    float_model, variables, tokenizer, config = load_minilm()
    model = type(float_model)(dataclasses.replace(config, mask_bias=MASK_BIAS))
    cal_ids, cal_mask = tokenize(tokenizer, load_sentences("calibration_sentences.txt"), seq_len=SEQ_LEN)
    calibration = [(cal_ids[i:i + 16], cal_mask[i:i + 16]) for i in range(0, len(cal_ids), 16)]
    ids, mask = tokenize(tokenizer, load_sentences("sentences.txt"), seq_len=SEQ_LEN)
    reference = np.asarray(jax.jit(float_model.apply)(variables, ids, mask), np.float64)

    candidates = [odmlq.Candidate("int8", weight_qtype="int8", act_qtype="int8", act_calibration=odmlq.MSE()),
                  "int16x8", "float"]
    tuned, seconds = {}, {}
    for name, target in (("autotune", odmlq.TuneTarget(min_cosine=0.995)),
                         ("autotune, latency <= 1x float", odmlq.TuneTarget(min_cosine=0.995,
                                                                            max_latency_ratio=1.0))):
        start = time.perf_counter()
        tuned[name] = odmlq.autotune(model, variables, calibration, target=target, candidates=candidates,
                                     check=False)
        seconds[name] = time.perf_counter() - start
        print(f"## MiniLM: {target.describe()} on the calibration sentences\n{tuned[name]}\n")

    out_dir = tempfile.mkdtemp(prefix="odmlq_autotune_minilm_")
    rows, files = [], []
    for name, rules in (("float", []), ("hand-written int8+int16", SCHEMAS["int8+int16"]),
                        *((name, result.rules) for name, result in tuned.items())):
        path = os.path.join(out_dir, name.replace(" ", "_") + ".tflite")
        export = odmlq.export_tflite(model, rules, calibration, path, variables=variables, allow_float_ops=True)
        embeddings, _ = run_tflite(path, ids, mask)
        cosine = np.sum(embeddings * reference, 1) / (np.linalg.norm(embeddings, axis=1)
                                                      * np.linalg.norm(reference, axis=1))
        unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
        verified = "-" if not rules else ("yes" if export.verification.passed else "NO")
        rows.append([name, f"{cosine.mean():.4f}", f"{cosine.min():.4f}",
                     f"{retrieval(unit, reference, np.arange(2 * PARAPHRASE_PAIRS)):.3f}",
                     f"{os.path.getsize(path) / 1e6:.3f}", str(export.delegation.partitions), verified])
        files.append(export.tflite)
    latency = odmlq.litert.interleaved_latency(files, [ids[:1], mask[:1]], rounds=9, invokes=20)
    print("; ".join(f"{name} took {spent:.0f} s" for name, spent in seconds.items()) + "\n")
    print("| rules | cosine mean | cosine min | paraphrase top-1 | MB | XNNPACK partitions | verified | "
          "ms/sentence | vs float |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, ms in zip(rows, latency):
        print("| " + " | ".join(row) + f" | {ms:.2f} | {ms / latency[0]:.2f}x |")


if __name__ == "__main__":
    main()
