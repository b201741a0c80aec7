"""XLA PTQ on CPU: float vs each schema, latency and bytes of params.

Prints two markdown tables:

1. Every schema of `odmlq.ptq` on a 4096-4096-4096 MLP (two 4096x4096
   layers, 128 MiB of float weights, more than this CPU's 32 MiB L3) and on
   the trained digits MLP and CNN: bytes of params, median latency at batch 1
   and 32 (runs of all schemas interleaved, so that load on the machine hits
   them alike), each as a ratio to float, output SQNR against float, and top-1
   accuracy on the digits test split.
2. The lowerings tried for one 4096x4096 layer (what `odmlq.xla._ops`
   ships, and what it beat).

Run: ``python bench/xla_ptq.py [--rounds 30]`` (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import odmlq
from odmlq import PerBlock, PerChannel, Rule
from odmlq.timing import interleaved_ms
from samples.digits import batches, load_digits_splits, train


class MLP4096(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(4096, name="fc1")(x))
        return nn.Dense(4096, name="fc2")(x)


def schemas(block: int, conv: bool) -> dict[str, list[Rule]]:
    """The schemas of the table; blocks apply to matmuls (a CNN's convolutions stay per channel)."""
    def blocked(qtype):
        rules = [Rule(".*", op="conv", weight_qtype=qtype)] if conv else []
        return rules + [Rule(".*", weight_qtype=qtype, weight_granularity=PerBlock(block))]

    return {
        "int8 weight-only": [Rule(".*", weight_qtype="int8")],
        "int4 weight-only": [Rule(".*", weight_qtype="int4")],
        f"int4 weight-only, blocks of {block}": blocked("int4"),
        "fp8 e4m3 weight-only": [Rule(".*", weight_qtype="fp8_e4m3")],
        f"nf4 weight-only, blocks of {block} (emulated)": blocked("nf4"),
        "w8a8 dynamic (per row)": [Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True,
                                        act_granularity=PerChannel(0))],
        "w8a8 static": [Rule(".*", weight_qtype="int8", act_qtype="int8")],
    }


def interleaved(candidates: dict, rounds: int) -> dict[str, float]:
    """Median ms per candidate ``name: (fn, args)``, one call each per round, in rotating order."""
    return interleaved_ms({n: (lambda fn=fn, args=args: fn(*args)) for n, (fn, args) in candidates.items()},
                          rounds=rounds, repeats=1)


def sqnr_db(reference, other) -> float:
    reference, other = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    noise = np.sum((reference - other) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(reference**2) / noise))


def bench_model(label, model, variables, example, calibration_data, rules_by_schema, inputs, rounds, test=None):
    float_bytes = sum(np.asarray(v).nbytes for v in jax.tree.leaves(variables))
    models = {"float32": (jax.jit(model.apply), variables)}
    for schema, rules in rules_by_schema.items():
        plan = odmlq.plan(model, rules, example, variables=variables)
        calibration = None
        if any(p.spec is not None and not p.spec.dynamic for p in plan.edges.values()):
            calibration = odmlq.calibrate(model, plan, calibration_data, variables=variables)
        qmodel = odmlq.ptq(model, plan, variables, calibration)
        models[schema] = (jax.jit(qmodel.apply), qmodel.params, qmodel.nbytes)
    latency = {b: interleaved({n: (m[0], (m[1], inputs[b])) for n, m in models.items()}, rounds) for b in inputs}
    reference = models["float32"][0](variables, inputs[32])
    rows = []
    for name, entry in models.items():
        nbytes = float_bytes if name == "float32" else entry[2]
        row = [label, name, f"{nbytes / 2**20:.2f} MiB", f"{float_bytes / nbytes:.1f}x"]
        for b in (1, 32):
            ms = latency[b][name]
            row += [f"{ms:.3f}", f"{ms / latency[b]['float32']:.2f}"]
        y = entry[0](entry[1], inputs[32])
        row.append("-" if name == "float32" else f"{sqnr_db(reference, y):.1f}")
        if test is not None:
            logits = entry[0](entry[1], test[0])
            row.append(f"{np.mean(np.argmax(np.asarray(logits), -1) == test[1]):.4f}")
        else:
            row.append("-")
        rows.append(row)
    return rows


def lowering_study(rounds: int) -> list[list[str]]:
    """One 4096x4096 layer, each way of running it that was tried."""
    k = n = 4096
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    codes = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
    codes_nk = jnp.asarray(np.asarray(codes).T.copy())
    scale = jnp.asarray(rng.uniform(0.01, 0.02, (n,)), jnp.float32)
    dn = (((1,), (0,)), ((), ()))

    def blocked(x, codes, rows, integer, scale=None):
        xs = x.reshape(x.shape[0], k // rows, rows).transpose(1, 0, 2)

        def step(acc, xw):
            xb, wb = xw
            if integer:
                return acc + lax.dot_general(xb, wb, dn, preferred_element_type=jnp.int32), None
            values = wb.astype(jnp.float32)
            return acc + xb @ (values if scale is None else values * scale), None

        init = jnp.zeros((x.shape[0], n), jnp.int32 if integer else jnp.float32)
        return lax.scan(step, init, (xs, codes.reshape(k // rows, rows, n)))[0]

    # Weights are arguments, as in a served model: as closed-over constants XLA
    # would fold the dequantization away at compile time.
    ways = {
        "float32 dot": lambda x, xq, w, c, c_nk, s: x @ w,
        "weight-only: dequantize whole weight, then f32 dot": lambda x, xq, w, c, c_nk, s: x @ (
            c.astype(jnp.float32) * s),
        **{f"weight-only: scale each block of {r} rows, then dot": (
            lambda x, xq, w, c, c_nk, s, r=r: blocked(x, c, r, False, s)) for r in (64, 256)},
        **{f"weight-only: convert block of {r} rows, dot, scale the sum{' (shipped)' if r == 256 else ''}": (
            lambda x, xq, w, c, c_nk, s, r=r: blocked(x, c, r, False) * s) for r in (64, 256, 1024)},
        "w8a8: s8 x s8 -> s32 dot, whole weight (K, N)": lambda x, xq, w, c, c_nk, s: lax.dot_general(
            xq, c, dn, preferred_element_type=jnp.int32),
        "w8a8: s8 x s8 -> s32 dot, whole weight stored (N, K)": lambda x, xq, w, c, c_nk, s: lax.dot_general(
            xq, c_nk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32),
        **{f"w8a8: s8 dot per block of {r} rows{' (shipped)' if r == 256 else ''}": (
            lambda x, xq, w, c, c_nk, s, r=r: blocked(xq, c, r, True)) for r in (256, 1024)},
    }
    rows = []
    results = {}
    for b in (1, 32):
        x = jnp.asarray(rng.standard_normal((b, k)), jnp.float32)
        xq = jnp.asarray(rng.integers(-128, 128, (b, k)), jnp.int8)
        args = (x, xq, w, codes, codes_nk, scale)
        results[b] = interleaved({name: (jax.jit(f), args) for name, f in ways.items()}, rounds)
    for name in ways:
        rows.append([name] + [f"{results[b][name]:.2f} ({results[b][name] / results[b]['float32 dot']:.2f})"
                              for b in (1, 32)])
    return rows


def table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(rounds: int = 30) -> None:
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {rounds} interleaved rounds, median\n")
    rows = []
    mlp, x1 = MLP4096(), jnp.zeros((1, 4096), jnp.float32)
    variables = jax.jit(mlp.init)(jax.random.key(0), x1)
    rng = np.random.default_rng(1)
    calibration = [rng.standard_normal((32, 4096)).astype(np.float32) for _ in range(4)]
    inputs = {b: jnp.asarray(rng.standard_normal((b, 4096)), jnp.float32) for b in (1, 32)}
    rows += bench_model("MLP 4096x4096 x2", mlp, variables, x1, calibration, schemas(128, False), inputs, rounds)
    digits = load_digits_splits()
    for name, block in (("mlp", 32), ("cnn", 32)):
        model, sample_variables = train(name, digits, seconds=10, max_steps=300)
        inputs = {b: jnp.asarray(digits.x_test[:b]) for b in (1, 32)}
        rows += bench_model(f"digits {name.upper()}", model, sample_variables, digits.x_test[:1],
                            batches(digits.x_calibration, 64), schemas(block, name == "cnn"), inputs, rounds,
                            test=(jnp.asarray(digits.x_test), digits.y_test))
    print(table(["model", "schema", "params", "smaller", "batch 1 ms", "ratio", "batch 32 ms", "ratio",
                 "SQNR vs float dB", "digits top-1"], rows))
    print("\nOne 4096x4096 layer, ms (ratio to float32):\n")
    print(table(["lowering", "batch 1", "batch 32"], lowering_study(rounds)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    main(parser.parse_args().rounds)
