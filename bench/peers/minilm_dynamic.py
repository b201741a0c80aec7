"""MiniLM dynamic-range, odmlq against AI Edge Quantizer, timed in the same rounds.

odmlq's export uses the MiniLM sample's dynamic rules (`samples/minilm_tflite.py`),
once as they are (an int8 word-embedding table) and once with the table kept
float, as the peer keeps it.
The peer is AI Edge Quantizer's ``dynamic_wi8_afp32`` recipe, applied to odmlq's
float export of the same model (its documented flow: quantize a float .tflite).
Both files, and the float one, run one 64-token sentence per invoke on one
thread, timed in the same interleaved rounds. The table gives bytes, XNNPACK
partitions, mean and minimum cosine to the float Flax embeddings over the
sample's 227 sentences, and the median ms per invoke.

Run in the peers' environment (bench/peers/README.md) with the MiniLM wheel:
  .venv-peers/bin/python bench/peers/minilm_dynamic.py [--rounds 7]
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import odmlq  # noqa: E402


def embeddings(tflite: bytes, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One sentence per invoke; inputs matched by name (input_ids, attention_mask)."""
    runner = odmlq.litert.interpreter(tflite, num_threads=1)
    details = {d["name"]: d for d in runner.get_input_details()}
    inputs = [next(d for n, d in details.items() if key in n) for key in ("input_ids", "attention_mask")]
    out = runner.get_output_details()[0]
    rows = []
    for i in range(len(ids)):
        for d, x in zip(inputs, (ids[i:i + 1], mask[i:i + 1])):
            runner.set_tensor(d["index"], x.astype(d["dtype"]))
        runner.invoke()
        rows.append(np.asarray(runner.get_tensor(out["index"]), np.float64).reshape(-1))
    return np.stack(rows)


def main(rounds: int = 7) -> None:
    import jax
    from ai_edge_quantizer import quantizer, recipe

    from converters.minilm import load_minilm, tokenize
    from samples.minilm_tflite import MASK_BIAS, SCHEMAS, SEQ_LEN, load_sentences

    float_model, variables, tokenizer, config = load_minilm()
    model = type(float_model)(dataclasses.replace(config, mask_bias=MASK_BIAS))
    ids, mask = tokenize(tokenizer, load_sentences("sentences.txt"), seq_len=SEQ_LEN)
    cal_ids, cal_mask = tokenize(tokenizer, load_sentences("calibration_sentences.txt"), seq_len=SEQ_LEN)
    calibration = [(cal_ids[i:i + 16], cal_mask[i:i + 16]) for i in range(0, len(cal_ids), 16)]
    reference = np.asarray(jax.jit(float_model.apply)(variables, ids, mask), np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float_export = odmlq.export_tflite(model, [], calibration, variables=variables, verify=False)
        ours = odmlq.export_tflite(model, SCHEMAS["dynamic"], calibration, variables=variables)
        # The peer's table stays float: the same choice in odmlq's rules.
        float_table = odmlq.export_tflite(model, [odmlq.Rule("embeddings/word_embeddings", skip=True),
                                                  *SCHEMAS["dynamic"]], calibration, variables=variables)
    qt = quantizer.Quantizer(bytearray(float_export.tflite), recipe.dynamic_wi8_afp32())
    peer = bytes(qt.quantize().quantized_model)
    files = {"float": float_export.tflite, "odmlq dynamic": ours.tflite,
             "odmlq dynamic, float table": float_table.tflite, "litert_quantizer dynamic_wi8_afp32": peer}
    # Timed on the first sentence (64 tokens, as every sentence is padded to).
    outputs = {name: embeddings(tflite, ids, mask) for name, tflite in files.items()}
    ms = odmlq.litert.interleaved_latency(list(files.values()), [ids[:1], mask[:1]], rounds=rounds)
    print("| file | bytes | XNNPACK partitions | cosine mean | cosine min | ms / sentence | vs float |")
    print("|---|---|---|---|---|---|---|")
    for (name, tflite), t in zip(files.items(), ms):
        e = outputs[name]
        cosine = np.sum(e * reference, 1) / (np.linalg.norm(e, axis=1) * np.linalg.norm(reference, axis=1))
        partitions = odmlq.litert.delegation(tflite, odmlq.litert.inspect(tflite)).partitions
        print(f"| {name} | {len(tflite):,} | {partitions} | {cosine.mean():.4f} | {cosine.min():.4f} | {t:.2f} | "
              f"{t / ms[0]:.2f} |")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    main(parser.parse_args().rounds)
