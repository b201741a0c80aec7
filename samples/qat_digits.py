"""Quantization-aware training of the digits CNN: PTQ against QAT, and the QAT model on LiteRT.

Two schemas of the digits CNN (`samples.models`, trained 600 Adam steps,
seed 0):

- ``int4 weights, int8 activations``: what LiteRT runs. PTQ loses little on
  this task; the QAT model is exported to a full-integer .tflite, verified
  op by op against the trained model, and its test accuracy measured in the
  LiteRT interpreter.
- ``int4 weights, int3 activations``: a schema where PTQ loses several
  points (3-bit activations: 8 levels per tensor). It runs in `simulate`
  and on XLA (`ptq`), not on LiteRT, whose kernels take 8- and 16-bit
  activations.

PTQ is measured with both weight roundings (GPTQ, odmlq's default, and round
to nearest); QAT (`odmlq.qat`, the same rules) starts from the GPTQ model,
its activation ranges held at the calibrated ones, and trains by distillation
on the training split: the float model's class probabilities are the targets
(cross-entropy, Adam 1e-3, batch 64, 600 steps), three times with different
batch orders (seeds 0, 1, 2); the mean is reported, and the first run is
exported. Accuracy is on the test split, which neither calibration nor
training sees. LiteRT's XNNPACK takes no int4 convolution filter, so the
w4a8 file's two convolutions run on LiteRT's reference kernels (the export
warns; the row lists them).

Run it: ``python -m samples.qat_digits [--out DIR]`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np
import optax

import odmlq
from samples.digits import batches, load_digits_splits, train

SCHEMAS = {
    "int4 weights, int8 activations": dict(weight_qtype="int4", act_qtype="int8"),
    "int4 weights, int3 activations": dict(weight_qtype="int4", act_qtype="int3"),
}
LITERT = "int4 weights, int8 activations"
STEPS, BATCH, LEARNING_RATE, SEEDS = 600, 64, 1e-3, (0, 1, 2)


def _accuracy(logits, labels) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), axis=-1) == labels))


def _ptq(model, variables, rules, data, target: str) -> float:
    plan = odmlq.plan(model, rules, data.x_calibration[:1], variables=variables, target=target)
    calibration = odmlq.calibrate(model, plan, batches(data.x_calibration, 64), variables=variables,
                                  progress=False)
    logits = odmlq.simulate(model, plan, calibration, data.x_test, variables=variables)
    return _accuracy(logits, data.y_test)


def qat_train(q, data, teacher: np.ndarray, steps: int = STEPS, seed: int = 0):
    """`steps` of distillation of `q` from its start, the ranges held at `q.stats`."""
    trainable, rest = q.params["params"], {k: v for k, v in q.params.items() if k != "params"}
    optimizer = optax.adam(LEARNING_RATE)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, opt_state, x, soft):
        def loss(p):
            logits = q.apply({"params": p, **rest}, q.stats, x)
            return optax.softmax_cross_entropy(logits, soft).mean()
        grads = jax.grad(loss)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = rng.choice(len(data.x_train), BATCH, replace=False)
        trainable, opt_state = step(trainable, opt_state, data.x_train[rows], teacher[rows])
    return {"params": trainable, **rest}


def _tflite_logits(tflite: bytes, images: np.ndarray) -> np.ndarray:
    """One image per invoke, as the file was exported (batch 1)."""
    runner = odmlq.litert.interpreter(tflite, num_threads=1)
    inp, out = runner.get_input_details()[0], runner.get_output_details()[0]
    rows = []
    for image in images:
        runner.set_tensor(inp["index"], image[None])
        runner.invoke()
        rows.append(runner.get_tensor(out["index"])[0])
    return np.stack(rows)


def main(out_dir: str = "out", steps: int = STEPS) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    data = load_digits_splits()
    model, variables = train("cnn", data, seconds=1e9, max_steps=600, seed=0)
    results = {"float": _accuracy(model.apply(variables, data.x_test), data.y_test)}
    teacher = np.asarray(jax.nn.softmax(model.apply(variables, data.x_train)))
    print(f"float CNN test accuracy {results['float']:.4f}")
    for name, fields in SCHEMAS.items():
        target = "both" if name == LITERT else "xla"
        rules = [odmlq.Rule(".*", **fields)]
        row = {"ptq_gptq": _ptq(model, variables, rules, data, target),
               "ptq_nearest": _ptq(model, variables,
                                   [odmlq.Rule(".*", **fields, weight_algorithm=odmlq.Nearest())], data, target)}
        q = odmlq.qat(model, rules, batches(data.x_calibration, 64), variables=variables, target=target,
                      progress=False)
        trained = [qat_train(q, data, teacher, steps, seed) for seed in SEEDS]
        row["qat_seeds"] = [_accuracy(q.apply(p, q.stats, data.x_test), data.y_test) for p in trained]
        row["qat"] = float(np.mean(row["qat_seeds"]))
        params = trained[0]
        reference = q.apply(params, q.stats, data.x_test)
        best = max(row["ptq_gptq"], row["ptq_nearest"])
        row["recovered"] = ((row["qat"] - best) / (results["float"] - best)
                            if results["float"] > best else float("nan"))
        if name == LITERT:
            exported = q.export_tflite(params, q.stats, os.path.join(out_dir, "digits_cnn_qat_w4a8.tflite"),
                                       rep_dataset=batches(data.x_calibration, 64), progress=False)
            logits = _tflite_logits(exported.tflite, data.x_test)
            lsb = float(np.max(exported.scales.edges[q.plan.graph.outputs[0]].scale))
            row.update(tflite=_accuracy(logits, data.y_test), bytes=len(exported.tflite),
                       tflite_max_lsb=float(np.max(np.abs(logits - np.asarray(reference)))) / lsb,
                       partitions=exported.delegation.partitions,
                       outside_xnnpack=[op.name for op in exported.delegation.outside])
        results[name] = row
        print(f"{name}: PTQ {row['ptq_gptq']:.4f} (GPTQ) / {row['ptq_nearest']:.4f} (nearest), "
              f"QAT {row['qat']:.4f} (seeds {', '.join(f'{a:.4f}' for a in row['qat_seeds'])})" + (f" ({row['recovered']:.0%} of the PTQ loss recovered)"
                                          if row["recovered"] == row["recovered"] else "")
              + (f"; .tflite {row['tflite']:.4f}, {row['bytes']:,} bytes, outputs within "
                 f"{row['tflite_max_lsb']:.2f} LSB of the QAT model" if "tflite" in row else ""))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    main(args.out)
