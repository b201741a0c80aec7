"""Train the small decoder (`samples.decoder_model`) on English that ships with Python, and save it.

The text is Python's own documentation as the standard library carries it
offline (`pydoc_data.topics`: 79 topics, about 465 KB). Tokens are bytes
(vocabulary 256, nothing to download or train). Every tenth topic, in
sorted order, is held out; the model trains on random windows of the rest
and its perplexity per byte is measured on the held-out topics.

Training: AdamW (weight decay 0.01), learning rate warmed up over 100 steps
to `LEARNING_RATE` and decayed to a tenth on a cosine, batches of
`BATCH` windows of `WINDOW` bytes, next-byte cross-entropy. The checkpoint
is written with `converters.decoder.save_decoder` (safetensors).

Run it: ``python -m samples.decoder_lm [--steps N] [--out DIR]`` (the
default model, 3.2M parameters, trains in about 15 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import jax
import numpy as np
import optax

from samples.decoder_model import Decoder, DecoderConfig

WINDOW, BATCH, LEARNING_RATE, STEPS, HELD_OUT_EVERY = 128, 16, 3e-3, 1500, 10


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """``(training bytes, held-out bytes)`` as uint8 arrays: the pydoc topics, every
    tenth (sorted by name) held out, topics joined by a blank line."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = set(names[::HELD_OUT_EVERY])

    def joined(selected):
        return np.frombuffer("\n\n".join(topics[n] for n in selected).encode("utf-8"), np.uint8)

    return joined([n for n in names if n not in held]), joined([n for n in names if n in held])


def windows(text: np.ndarray, length: int) -> np.ndarray:
    """Consecutive non-overlapping windows of ``length + 1`` bytes (inputs and next-byte targets)."""
    count = (len(text) - 1) // length
    starts = np.arange(count) * length
    return np.stack([text[s:s + length + 1] for s in starts]).astype(np.int32)


def perplexity(apply, text: np.ndarray, length: int = WINDOW, batch: int = 32) -> float:
    """Per-byte perplexity of `text` under ``apply(tokens) -> logits``, over
    consecutive windows of `length` (each starting from an empty context)."""
    rows = windows(text, length)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        logits = np.asarray(apply(chunk[:, :-1]), np.float64)
        logits = logits - logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        total -= float(np.take_along_axis(log_probs, chunk[:, 1:, None], axis=-1).sum())
        count += chunk[:, 1:].size
    return math.exp(total / count)


def train(config: DecoderConfig = DecoderConfig(), steps: int = STEPS, seed: int = 0, log_every: int = 250):
    """Trains a `Decoder` on the training topics. Returns ``(model, variables, losses)``."""
    training, _ = corpus()
    model = Decoder(config)
    variables = model.init(jax.random.key(seed), np.zeros((1, WINDOW), np.int32))
    schedule = optax.warmup_cosine_decay_schedule(0.0, LEARNING_RATE, 100, max(steps, 101), LEARNING_RATE / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    params, opt_state = variables["params"], optimizer.init(variables["params"])

    @jax.jit
    def step(params, opt_state, batch):
        def loss(p):
            logits = model.apply({"params": p}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    losses, start = [], time.perf_counter()
    for i in range(steps):
        starts = rng.integers(0, len(training) - WINDOW - 1, BATCH)
        batch = np.stack([training[s:s + WINDOW + 1] for s in starts]).astype(np.int32)
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
        if log_every and (i + 1) % log_every == 0:
            print(f"  step {i + 1}: loss {np.mean(losses[-log_every:]):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    return model, {"params": jax.tree.map(np.asarray, params)}, losses


def main(out_dir: str = "out", steps: int = STEPS, config: DecoderConfig = DecoderConfig()) -> dict:
    from converters.decoder import save_decoder

    os.makedirs(out_dir, exist_ok=True)
    training, held_out = corpus()
    size = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        Decoder(config).init, jax.random.key(0), np.zeros((1, 1), np.int32))))
    print(f"pydoc topics: {len(training):,} training bytes, {len(held_out):,} held out; "
          f"decoder of {size:,} parameters ({dataclasses.asdict(config)})", flush=True)
    start = time.perf_counter()
    model, variables, losses = train(config, steps)
    seconds = time.perf_counter() - start
    apply = jax.jit(lambda tokens: model.apply(variables, tokens))
    result = {"parameters": size, "steps": steps, "seconds": seconds, "final_loss": float(np.mean(losses[-50:])),
              "perplexity": perplexity(apply, held_out), "training_perplexity": perplexity(apply, training[:len(held_out)])}
    path = os.path.join(out_dir, "decoder.safetensors")
    save_decoder(path, variables, config)
    result["checkpoint"] = path
    print(f"trained {steps} steps in {seconds:.0f} s; held-out perplexity {result['perplexity']:.3f} per byte "
          f"({math.log2(result['perplexity']):.3f} bits), training text {result['training_perplexity']:.3f}; "
          f"saved {path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    main(args.out, args.steps)
