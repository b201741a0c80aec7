"""all-MiniLM-L6-v2 to LiteRT: int8, int16x8 and dynamic-range, measured against float.

Run: ``python -m samples.minilm_tflite [--out DIR] [--schemas int8,int16x8,dynamic,float]``

For each schema the model is exported with `odmlq.export_tflite` (calibrated
on ``samples/calibration_sentences.txt``, verified op by op against simulate)
and the .tflite run by the LiteRT interpreter, one sentence at a time, on the
227 sentences of ``samples/sentences.txt`` (none of them seen in calibration).
It prints, per schema: mean and minimum cosine similarity to the float Flax
embeddings, nearest-neighbour agreement with float (top-1; see `retrieval`),
file size, latency per sentence (1 thread) and the ops left in float, grouped
by module, with the reason.

Retrieval is measured two ways, both searching all 227 sentences:

- top-1 paraphrase: the 80 sentences written as 40 paraphrase pairs (lines
  1-80) are the queries; each has a related sentence in the set, as a
  search query has a relevant document. This is the retrieval figure.
- top-1 all: every sentence is a query. The other 147 sentences are about
  unrelated things ("Stop.", "Shakespeare wrote Hamlet around the year
  1600."), so their nearest neighbour is the least unrelated sentence, with
  a median float margin of 0.03 cosine over the second: it measures how
  closely a model reproduces float's ranking of near-ties. Any quantization
  moves it: int8 weights with float activations alone score 0.982
  (simulated), bfloat16 weights and compute 1.000.

The rules (`SCHEMAS`), and why:

- The attention mask bias is -30, not BERT's -1e4 (`MiniLMConfig.mask_bias`):
  the float embeddings are the same (a padded key's weight is ~1e-13 either
  way), but a quantized score edge holding -1e4 has no resolution left for
  the real scores.

int8 (for speed on CPU): the 36 weight matmuls of the encoder are int8 and
every other op computes in float, so XNNPACK, LiteRT's CPU delegate, runs the
whole graph as one partition. XNNPACK runs int8 FULLY_CONNECTED, but no int8
SOFTMAX, GELU or RSQRT and no int16 op at all (its sources check float32 for
them), so quantizing those would put them on LiteRT's slower reference
kernels and split the graph.

- The two matmuls of each layer that write into the residual stream (the
  attention output and the FFN output) are dynamic: int8 weights, inputs
  quantized per token at run time, float output. The FFN output carries the
  residual stream's outlier channel (up to ~196 where the rest is within
  +-3, in every layer), which one int8 output scale rounds to 21-25 dB, and
  its input is GELU's long tail. Measured on the held-out sentences: with
  every matmul static, mean cosine 0.958 (minimum 0.75); the FFN outputs in
  float, 0.9947 at 0.53x float; the FFN outputs dynamic, 0.9942 (minimum
  0.919) at 0.28x; the attention outputs dynamic too, 0.9945 (minimum 0.951)
  at 0.28x. (All matmuls dynamic, the dynamic schema, is faster still here,
  0.17x, and closer to float: XNNPACK's dynamic kernels write float, where a
  static one writes int8 that is then dequantized.)
- The word-embedding table is int8 (its gathered rows keep its scale and are
  dequantized for the float adds).
- int8 activation ranges use MSE calibration.

int8+int16 (full integer where LiteRT has kernels; slower than float on CPU,
for accelerators that need integer inputs):

- LayerNorm has no LiteRT kernel; decomposed in int8 it loses ~15 dB per
  layer (the residual stream has outlier channels), and in int16 the
  converter refuses its ADD of the bias and epsilon ('operands should have
  valid shapes'). It stays in float: DEQUANTIZE, the float ops, QUANTIZE.
- The residual stream (the adds, and the attention-output and FFN-output
  matmuls that feed them) is int16: in int8 those edges lose 12-16 dB each
  (outlier channels again). The int8 matmuls around them read it through a
  QUANTIZE (`Plan.conversions`).
- The FFN-intermediate matmul (384 -> 1536, before the GELU) is int16 too:
  its output is the int8 schema's most sensitive edge (simulated, all other
  choices as here: mean cosine 0.9929 -> 0.9956, minimum 0.935 -> 0.960),
  for ~14% more latency. It reads the float LayerNorm output, so the int16
  is a QUANTIZE away.
- GELU's LiteRT kernel is int8 only, and it sits between two int16 edges
  (and an int8 -> int16 requantize after it is folded into it by
  litert-converter: refused, 'input and output must have same element
  type'), so the GELU is computed in float.
- The embedding adds (word + position + segment) read two weight tables: in
  int16 the converter refuses an ADD of a weight, and in int8 they lose
  ~19 dB. They stay in float; the gathered table is int8.
- int8 activation ranges use MSE calibration (MinMax lets a few outliers
  widen the whole range of the FFN and attention edges).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import odmlq
from odmlq.calibration import MSE

HERE = Path(__file__).parent
SEQ_LEN = 64
MASK_BIAS = -30.0
PARAPHRASE_PAIRS = 40  # lines 2k-1 and 2k of sentences.txt, k = 1..40

R = odmlq.Rule
_FLOAT_LAYER_NORM = R(r".*layer_norm", skip=True)
_FLOAT_GELU = R(r"encoder/layer_\d+", op="gelu", skip=True)
_FLOAT_EMBEDDING_ADDS = R(r"embeddings", op="add", skip=True)
_INT16_RESIDUAL = [R(r"encoder/layer_\d+", op="add", weight_qtype="int8", act_qtype="int16"),
                   R(r"encoder/layer_\d+/(attention/)?output", weight_qtype="int8", act_qtype="int16")]
_INT16_FFN_INTERMEDIATE = R(r"encoder/layer_\d+/intermediate", weight_qtype="int8", act_qtype="int16")

SCHEMAS: dict[str, list] = {
    "int8": [R(r"embeddings/word_embeddings", weight_qtype="int8", act_qtype="int8"),
             R(r"encoder/layer_\d+/(attention/)?output", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
             R(r"encoder/.*", op="dot_general", weight_qtype="int8", act_qtype="int8", act_calibration=MSE()),
             R(".*", skip=True)],
    "int8+int16": [_FLOAT_EMBEDDING_ADDS, _FLOAT_LAYER_NORM, _FLOAT_GELU, *_INT16_RESIDUAL, _INT16_FFN_INTERMEDIATE,
                   R(".*", weight_qtype="int8", act_qtype="int8", act_calibration=MSE())],
    "int16x8": [_FLOAT_EMBEDDING_ADDS, _FLOAT_LAYER_NORM, _FLOAT_GELU,
                # The mask add broadcasts (batch, 1, 1, keys) over the scores: an
                # int16 ADD of two shapes, which the converter refuses as written
                # (odmlq now broadcasts it first; these rules, measured before,
                # keep it float). A single
                # float op between quantized tensors is quantized by the
                # converter anyway, so the scaling MUL before it stays float too,
                # and the SOFTMAX after it: LiteRT's int16 SOFTMAX interpolates
                # tables for exp and 1/x (up to ~1/256 off), which verification
                # would allow only as that kernel's own tolerance.
                R(r"encoder/layer_\d+/attention", op=("mul", "add", "softmax"), skip=True),
                # GATHER_ND takes no int16 table: the lookup is int8, read by the float adds.
                R(r"embeddings/word_embeddings", weight_qtype="int8", act_qtype="int8"),
                # The mask and the pooling after the encoder are int8. (Its 1 - mask
                # in int16 exports and verifies too, since the export clears
                # pot_scale_int16: 0.99948 mean cosine against 0.99911 held out.)
                R(r"encoder", weight_qtype="int8", act_qtype="int8"),
                R(".*", weight_qtype="int8", act_qtype="int16")],
    # Hybrid kernels: int8 weights, activations quantized per call by the
    # matmuls; LayerNorm and embedding-add weights stay float (an elementwise op
    # has no hybrid kernel: its int8 weight would be dequantized every call).
    "dynamic": [_FLOAT_LAYER_NORM, _FLOAT_EMBEDDING_ADDS,
                R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
    "float": [],
}

_MASK_CAST = (r"encoder/convert_element_type", "the int32 attention mask cast to float (CAST: an integer "
                                              "input; pass a float32 mask to drop it)")
# Why ops stay in float, by the op path LiteRT's tensor names give them:
# in the int8 schema, by design; in the others, for want of a kernel.
INT8_FLOAT_REASONS = (
    (r"encoder/layer_\d+/(attention/)?output(/.*)?", "attention and FFN output matmuls: dynamic (float "
                                                     "output into the residual stream and its outlier channel)"),
    _MASK_CAST,
    (r".*", "float by the rules: XNNPACK has no int8 SOFTMAX, GELU or RSQRT and no int16 op, so "
            "LayerNorm, GELU, attention, the adds and the pooling run in float on it (one partition)"),
)
FLOAT_REASONS = (
    (r".*layer_norm(/.*)?", "LayerNorm: no LiteRT kernel; int8 decomposition loses ~15 dB, int16 "
                            "decomposition refused by litert-converter (ADD of bias/epsilon)"),
    (r"encoder/layer_\d+/gelu", "GELU: LiteRT's kernel is int8 only and it sits between int16 "
                                "edges (the int16 form odmlq writes is not in these measured rules)"),
    (r"embeddings/add.*", "embedding adds: int16 ADD of a weight refused by litert-converter; "
                          "int8 loses ~19 dB"),
    (r"encoder/layer_\d+/attention/(mul|add|softmax)",
     "attention scaling, mask add and softmax: kept float by these rules (measured before odmlq "
     "wrote an int16 ADD of two shapes); int16 SOFTMAX approximates (~1/256)"),
    _MASK_CAST,
)
BOUNDARY = "DEQUANTIZE into / QUANTIZE out of the float ops above"
STATIC = ("int8", "int8+int16", "int16x8")  # schemas whose float ops are listed, with why


def load_sentences(name: str) -> list[str]:
    return [s for s in (HERE / name).read_text(encoding="utf-8").splitlines() if s.strip()]


def retrieval(embeddings: np.ndarray, reference: np.ndarray, queries=None) -> float:
    """Top-1 nearest-neighbour agreement with `reference` (cosine; the query
    itself excluded): the share of queries whose nearest other sentence is
    the same under both sets of embeddings (both L2-normalized)."""
    queries = np.arange(len(embeddings)) if queries is None else np.asarray(queries)

    def nearest(e):
        similarity = e[queries] @ e.T
        similarity[np.arange(len(queries)), queries] = -np.inf
        return similarity.argmax(axis=1)

    return float(np.mean(nearest(embeddings) == nearest(reference)))


def run_tflite(path: str, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, float]:
    """Embeddings one sentence at a time with 1 thread, and the median seconds per sentence."""
    interpreter = odmlq.litert.interpreter(path, num_threads=1)
    by_name = {d["name"]: d for d in interpreter.get_input_details()}
    inputs = [next(d for n, d in by_name.items() if n.endswith(k)) for k in ("input_ids", "attention_mask")]
    output = interpreter.get_output_details()[0]
    out, seconds = [], []
    for i in range(len(ids)):
        for d, x in zip(inputs, (ids[i:i + 1], mask[i:i + 1])):
            interpreter.set_tensor(d["index"], x.astype(d["dtype"]))
        start = time.perf_counter()
        interpreter.invoke()
        seconds.append(time.perf_counter() - start)
        out.append(np.asarray(interpreter.get_tensor(output["index"]), np.float64).reshape(-1))
    return np.stack(out), float(np.median(seconds))


def float_ops_by_reason(summary, reasons=FLOAT_REASONS) -> list[tuple[str, int, str]]:
    """(reason, number of ops, their kinds) for the ops LiteRT computes in float."""
    groups: dict[str, dict[str, int]] = {}
    for op in summary.float_islands:
        path = op.module_path or ""
        reason = BOUNDARY if op.name in ("QUANTIZE", "DEQUANTIZE") else next(
            (why for pattern, why in reasons if re.fullmatch(pattern, path)), None)
        kinds = groups.setdefault(reason or f"not matched by a known reason ({path})", {})
        kinds[op.name] = kinds.get(op.name, 0) + 1
    return [(reason, sum(k.values()), ", ".join(f"{n} {name}" for name, n in sorted(k.items(), key=lambda x: -x[1])))
            for reason, k in groups.items()]


def measure(schema: str, out_dir: str, model, variables, calibration, evaluation, reference) -> dict:
    """Exports one schema and measures it against the float embeddings."""
    path = os.path.join(out_dir, f"minilm_{schema}.tflite")
    ids, mask = evaluation
    result = odmlq.export_tflite(model, SCHEMAS[schema], calibration, path, variables=variables,
                                 allow_float_ops=schema in STATIC)
    embeddings, seconds = run_tflite(path, ids, mask)
    norms = np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1)
    cosine = np.sum(embeddings * reference, axis=1) / norms
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    paraphrases = np.arange(2 * PARAPHRASE_PAIRS)
    return {
        "schema": schema, "path": path, "cosine_mean": float(cosine.mean()), "cosine_min": float(cosine.min()),
        "top1_all": retrieval(unit, reference), "top1_paraphrase": retrieval(unit, reference, paraphrases),
        "bytes": os.path.getsize(path), "latency_ms": 1000 * seconds,
        "float_ops": float_ops_by_reason(result.summary, INT8_FLOAT_REASONS if schema == "int8" else FLOAT_REASONS),
        "partitions": result.delegation.partitions,
        "verified": None if result.verification is None else result.verification.passed,
        "max_lsb": max((c.max_lsb for c in result.verification.checks), default=0.0),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the .tflite files (default: a temporary one)")
    parser.add_argument("--schemas", default="int8,int8+int16,int16x8,dynamic",
                        help="comma-separated, from " + ", ".join(SCHEMAS))
    args = parser.parse_args(argv)
    schemas = [s for s in args.schemas.split(",") if s]
    unknown = [s for s in schemas if s not in SCHEMAS]
    if unknown:
        parser.error(f"unknown schema(s) {unknown}; choose from {list(SCHEMAS)}")

    import jax

    from converters.minilm import load_minilm, tokenize

    float_model, variables, tokenizer, config = load_minilm()
    model = type(float_model)(dataclasses.replace(config, mask_bias=MASK_BIAS))
    sentences = load_sentences("sentences.txt")
    ids, mask = tokenize(tokenizer, sentences, seq_len=SEQ_LEN)
    cal_ids, cal_mask = tokenize(tokenizer, load_sentences("calibration_sentences.txt"), seq_len=SEQ_LEN)
    calibration = [(cal_ids[i:i + 16], cal_mask[i:i + 16]) for i in range(0, len(cal_ids), 16)]
    reference = np.asarray(jax.jit(float_model.apply)(variables, ids, mask), np.float64)

    out_dir = args.out or tempfile.mkdtemp(prefix="odmlq_minilm_")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for schema in schemas:
        start = time.perf_counter()
        results.append(measure(schema, out_dir, model, variables, calibration, (ids, mask), reference))
        print(f"# {schema}: exported, verified and measured in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    print(f"all-MiniLM-L6-v2 on {len(sentences)} sentences ({SEQ_LEN} tokens), LiteRT, 1 thread")
    header = ("schema", "cos mean", "cos min", "top-1 all", "top-1 paraphrase", "size MB",
              "ms/sentence", "XNNPACK partitions", "float ops", "max LSB vs simulate")
    rows = [(r["schema"], f"{r['cosine_mean']:.4f}", f"{r['cosine_min']:.4f}", f"{r['top1_all']:.3f}",
             f"{r['top1_paraphrase']:.3f}", f"{r['bytes'] / 1e6:.1f}", f"{r['latency_ms']:.1f}",
             str(r["partitions"]), str(sum(n for _, n, _ in r["float_ops"])), f"{r['max_lsb']:.3f}") for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for r in results:
        if r["float_ops"] and r["schema"] in STATIC:
            print(f"\n{r['schema']}: ops in float")
            for reason, n, kinds in r["float_ops"]:
                print(f"  {n:4d} ops  {reason}\n            ({kinds})")
    print(f"\n.tflite files in {out_dir}")
    return results


if __name__ == "__main__":
    main()
