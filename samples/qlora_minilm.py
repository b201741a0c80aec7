"""QLoRA on all-MiniLM-L6-v2: an nf4 base that stays nf4 while low-rank adapters train, then merged and exported.

The task is paraphrase retrieval, from the sentences that ship with the
samples (``samples/sentences.txt``): lines 1-80 are 40 paraphrase pairs,
the other 147 sentences are about unrelated things. Pairs 1-24 and the
first 74 unrelated sentences train; pairs 25-40 and the other 73 unrelated
sentences are held out. For each held-out sentence of a pair, its partner
must be the nearest of all held-out sentences (cosine of the embeddings).

Measured on the held-out sentences, for the float model, the frozen nf4
base (no adapters), the base with trained adapters, and the merged model
exported to a dynamic-range .tflite and run in LiteRT:

- top-1: the share of the 32 queries whose nearest sentence is the partner;
- margin: the partner's cosine minus the nearest other sentence's, averaged
  over the queries (how far the right answer is ahead; top-1 needs > 0);
- loss: the contrastive loss training minimizes, on the held-out queries.

The base (`odmlq.lora`, rules `QLORA_RULES`): every matmul's kernel and the
word embedding table are nf4 in blocks of 64, LayerNorms and the two small
embedding tables that are added stay float. Adapters of rank 8 (alpha 16)
sit on the 36 encoder matmuls. Training: Adam, learning rate 1e-3, batches
of 8 training pairs against each other and 16 unrelated sentences
(in-batch negatives, scale 20, the loss sentence-transformers trains MiniLM
with), both directions.

Run it: ``python -m samples.qlora_minilm [--steps N] [--out DIR]`` (needs the
MiniLM extra, see README; about 4 minutes on 2 CPU cores).
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
from samples.minilm_tflite import SCHEMAS, load_sentences

R = odmlq.Rule
QLORA_RULES = [
    R("embeddings", op="add", skip=True),  # position and segment tables, added: small, float
    R(r".*layer_norm", skip=True),
    R("embeddings/word_embeddings", weight_qtype="nf4", weight_granularity=odmlq.PerBlock(64, axis=1)),
    R(".*", weight_qtype="nf4", weight_granularity=odmlq.PerBlock(64)),
]
RANK, ALPHA, LEARNING_RATE, STEPS, PAIRS_PER_BATCH, NEGATIVES_PER_BATCH, SCALE = 8, 16.0, 1e-3, 60, 8, 8, 20.0
TRAINING_PAIRS, PAIRS, UNRELATED_SPLIT = 24, 40, 154  # sentences.txt lines 81-154 train, 155-227 are held out
SEQ_LEN = 64


def scrambled(sentence: str, rng: np.random.Generator) -> str:
    """The sentence's words in a random order (never the original one), its final stop kept."""
    stop = sentence[-1] if sentence[-1] in ".?!" else ""
    words = sentence[:len(sentence) - len(stop)].split()
    order = np.arange(len(words))
    while len(words) > 1 and np.array_equal(order, np.arange(len(words))):
        order = rng.permutation(len(words))
    return " ".join(words[i] for i in order) + stop


def _normalized(e) -> jax.Array:
    return e / jnp.linalg.norm(e, axis=-1, keepdims=True)


def contrastive_loss(queries: jax.Array, partners: jax.Array, negatives: jax.Array) -> jax.Array:
    """Cross-entropy of each query's partner among all partners and the
    negatives (cosine times `SCALE`), in both directions."""
    q, p, n = _normalized(queries), _normalized(partners), _normalized(negatives)
    labels = jnp.arange(q.shape[0])
    forward = SCALE * q @ jnp.concatenate([p, n]).T
    backward = SCALE * p @ jnp.concatenate([q, n]).T
    return 0.5 * (optax.softmax_cross_entropy_with_integer_labels(forward, labels).mean()
                  + optax.softmax_cross_entropy_with_integer_labels(backward, labels).mean())


def held_out_metrics(embeddings: np.ndarray, pairs: int) -> dict:
    """Retrieval over the held-out set, laid out as ``2 * pairs`` paraphrase
    sentences (partners adjacent), their scrambled copies in the same order,
    then the unrelated sentences; every paraphrase sentence is a query."""
    e = np.asarray(_normalized(jnp.asarray(embeddings, jnp.float32)), np.float64)
    n = 2 * pairs
    queries = np.arange(n)
    partner = queries ^ 1
    similarity = e[queries] @ e.T
    similarity[queries, queries] = -np.inf
    right = similarity[queries, partner]
    plain = np.delete(similarity, np.arange(n, 2 * n), axis=1)  # without the scrambled copies
    similarity[queries, partner] = -np.inf
    plain[queries, partner] = -np.inf
    margin = right - similarity.max(axis=1)
    loss = contrastive_loss(jnp.asarray(e[0:n:2]), jnp.asarray(e[1:n:2]), jnp.asarray(e[n:]))
    return {"top1": float(np.mean(margin > 0)), "margin": float(np.mean(margin)),
            "top1_plain": float(np.mean(right > plain.max(axis=1))), "loss": float(loss)}


def _sets(sentences: list[str]) -> tuple[list[str], list[str]]:
    """Training and held-out sentences: paraphrase pairs, their scrambled copies, unrelated sentences."""
    rng = np.random.default_rng(0)

    def laid_out(pairs: list[str], unrelated: list[str]) -> list[str]:
        return pairs + [scrambled(s, rng) for s in pairs] + unrelated

    return (laid_out(sentences[:2 * TRAINING_PAIRS], sentences[2 * PAIRS:UNRELATED_SPLIT]),
            laid_out(sentences[2 * TRAINING_PAIRS:2 * PAIRS], sentences[UNRELATED_SPLIT:]))


def train(adapted: odmlq.LoRA, training: tuple[np.ndarray, np.ndarray], steps: int, seed: int = 0):
    """Adam on the adapters; the base is an argument of the jitted step, never a float copy.
    Each batch: `PAIRS_PER_BATCH` pairs, the scrambled copies of their sentences (the hard
    negatives) and `NEGATIVES_PER_BATCH` unrelated sentences."""
    ids, mask = training
    n = 2 * TRAINING_PAIRS
    optimizer = optax.adam(LEARNING_RATE)

    @jax.jit
    def step(adapters, opt_state, frozen, ids, mask):
        def loss(adapters):
            e = adapted.apply(adapters, ids, mask, frozen=frozen)
            k = 2 * PAIRS_PER_BATCH
            return contrastive_loss(e[0:k:2], e[1:k:2], e[k:])
        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    rng = np.random.default_rng(seed)
    adapters, opt_state, losses = adapted.adapters, optimizer.init(adapted.adapters), []
    for _ in range(steps):
        pairs = rng.choice(TRAINING_PAIRS, PAIRS_PER_BATCH, replace=False)
        rows = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
        unrelated = 2 * n + rng.choice(len(ids) - 2 * n, NEGATIVES_PER_BATCH, replace=False)
        batch = np.concatenate([rows, n + rows, unrelated])
        adapters, opt_state, value = step(adapters, opt_state, adapted.frozen, ids[batch], mask[batch])
        losses.append(float(value))
    return adapters, losses


def _tflite_embeddings(tflite: bytes, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    runner = odmlq.litert.interpreter(tflite, num_threads=1)
    inputs, output = runner.get_input_details(), runner.get_output_details()[0]
    rows = []
    for row in range(len(ids)):
        for detail, value in zip(inputs, (ids, mask)):
            runner.set_tensor(detail["index"], value[row:row + 1].astype(detail["dtype"]))
        runner.invoke()
        rows.append(runner.get_tensor(output["index"])[0])
    return np.stack(rows)


def main(out_dir: str = "out", steps: int = STEPS) -> dict:
    from converters.minilm import load_minilm, tokenize

    os.makedirs(out_dir, exist_ok=True)
    model, variables, tokenizer, _ = load_minilm()
    training, held_out = (tokenize(tokenizer, sentences, seq_len=SEQ_LEN)
                          for sentences in _sets(load_sentences("sentences.txt")))
    held_pairs = PAIRS - TRAINING_PAIRS
    results = {"float": held_out_metrics(jax.jit(model.apply)(variables, *held_out), held_pairs)}

    adapted = odmlq.lora(model, QLORA_RULES, (held_out[0][:1], held_out[1][:1]), variables=variables,
                         rank=RANK, alpha=ALPHA)
    float_variables, variables = variables, None  # training holds the nf4 base, not these
    embed = jax.jit(lambda adapters, frozen, ids, mask: adapted.apply(adapters, ids, mask, frozen=frozen))
    results["memory"] = {"base_bytes": adapted.base_bytes, "float_bytes": adapted.float_bytes,
                         "adapter_values": adapted.adapter_count}
    results["frozen"] = held_out_metrics(embed(adapted.adapters, adapted.frozen, *held_out), held_pairs)
    start = time.perf_counter()
    adapters, losses = train(adapted, training, steps)
    results["training"] = {"seconds": time.perf_counter() - start, "first_loss": float(np.mean(losses[:10])),
                           "last_loss": float(np.mean(losses[-10:]))}
    results["qlora"] = held_out_metrics(embed(adapters, adapted.frozen, *held_out), held_pairs)

    merged = adapted.merge(adapters)
    calibration = [training]
    exported = odmlq.export_tflite(model, SCHEMAS["dynamic"], calibration,
                                   os.path.join(out_dir, "minilm_qlora_dynamic.tflite"), variables=merged,
                                   progress=False)
    results["tflite"] = held_out_metrics(_tflite_embeddings(exported.tflite, *held_out), held_pairs)
    results["tflite"].update(bytes=len(exported.tflite), partitions=exported.delegation.partitions)
    del float_variables
    _print(results)
    return results


def _print(results: dict) -> None:
    memory, training = results["memory"], results["training"]
    print(f"nf4 base: {memory['base_bytes'] / 1e6:.2f} MB stored, {memory['float_bytes'] / 1e6:.2f} MB in float32 "
          f"({memory['base_bytes'] / memory['float_bytes']:.2f}x); {memory['adapter_values']:,} adapter values")
    print(f"training: contrastive loss {training['first_loss']:.3f} (first 10 steps) -> {training['last_loss']:.2g} "
          f"(last 10), {training['seconds']:.0f} s")
    print(f"{'held-out paraphrase retrieval':<44} top-1   margin   loss    top-1 without scrambled copies")
    names = {"float": "float MiniLM", "frozen": "nf4 base, no adapters", "qlora": "nf4 base + trained adapters",
             "tflite": "merged, dynamic-range .tflite (LiteRT)"}
    for key, name in names.items():
        row = results[key]
        print(f"{name:<44} {row['top1']:.3f}  {row['margin']:+.4f}  {row['loss']:.3f}   {row['top1_plain']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    main(args.out, steps=args.steps)
