"""LiteRT's int16 RSQRT reads a 513-entry table (`odmlq.litert._tables`).

The table is reproduced bit for bit here, so the export knows, from the
calibrated inputs, where it would miss simulate: an int16 RSQRT whose table is
off by more than the op table's tolerance on those inputs (it used to fail
verification, blamed on the converter; then it was refused before conversion)
is exported in pieces whose tables each read a range of 8x."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

import odmlq
from odmlq.litert._tables import _rsqrt, int16_table, lookup, rsqrt_table_error

INT16 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]


class _Rsqrt(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jax.lax.rsqrt(x)


@pytest.mark.parametrize("top", [0.003, 37.0])
def test_the_table_is_litert_s_for_every_code(top):
    model = _Rsqrt()
    x = np.linspace(top / 8, top, 64, dtype=np.float32)[None]  # within the table's accurate decade
    variables = model.init(jax.random.key(0), x)
    result = odmlq.export_tflite(model, INT16, [x, x], variables=variables, benchmark=False, verify=False)
    interpreter = Interpreter(model_content=result.tflite)
    interpreter.allocate_tensors()
    into, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    int16 = {d["name"]: d["quantization"][0] for d in interpreter.get_tensor_details() if d["dtype"] == np.int16}
    in_scale = next(s for n, s in int16.items() if "input" in n)
    out_scale = next(s for n, s in int16.items() if "rsqrt" in n)
    table = int16_table(_rsqrt(out_scale), in_scale, out_scale)
    codes = np.arange(32768).reshape(-1, 64)
    got = []
    for row in codes:
        interpreter.set_tensor(into["index"], (row * np.float32(in_scale)).astype(np.float32)[None])
        interpreter.invoke()
        got.append(np.round(interpreter.get_tensor(out["index"])[0] / np.float32(out_scale)))
    np.testing.assert_array_equal(np.concatenate(got), lookup(codes.reshape(-1), table))  # 0 LSB
    # On the calibrated inputs (the top eighth of the range) the table is within
    # a few LSB of the rounded 1/sqrt (6 measured: the export keeps it); from
    # the lowest code, hundreds (230 measured; its 1/sqrt clips there).
    assert rsqrt_table_error(in_scale, out_scale, top / 8)[0] <= 8.0
    assert rsqrt_table_error(in_scale, out_scale, in_scale)[0] > 100.0


class _RmsNorm(nn.Module):
    """Rows of varied loudness (variances spanning 3 decades), normalized."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="fc")(x)
        r = jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-3)
        return nn.Dense(5, name="out")(x * r)


def _loud_and_quiet(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 16)) * np.exp(rng.uniform(-4, 2, size=(n, 1)))).astype(np.float32)


def test_an_int16_rsqrt_its_table_misses_is_exported_in_pieces_and_verified():
    """Rows of loudness spanning 3 decades: one table was 14,984 LSB off on
    them (refused, or kept in float with allow_float_ops); in pieces each
    table reads its top eighth, and the export is full integer."""
    model, x = _RmsNorm(), _loud_and_quiet()
    batches = [x[i:i + 8] for i in range(0, 64, 8)]
    variables = model.init(jax.random.key(0), x[:1])
    result = odmlq.export_tflite(model, INT16, batches, variables=variables, benchmark=False)
    report = result.verification
    assert report.passed, str(report)
    assert result.summary.float_islands == ()
    assert result.summary.op_histogram["RSQRT"] >= 3  # pieces of 8x over 3 decades
    # Within 4 LSB of simulate (measured 2), zero variances included; the op
    # table allows 64 (a quarter of an int8 step).
    check = next(c for c in report.checks if c.edge == "fc/rsqrt")
    assert check.max_lsb <= 4.0
    assert abs(report.litert_float_sqnr_db - report.simulate_float_sqnr_db) < 0.5


def test_rsqrt_pieces_over_four_decades_are_within_a_few_lsb_of_one_over_sqrt_for_every_code():
    """Every input code through the interpreter against the rounded 1/sqrt:
    within 5 LSB from the calibrated low up (measured 5: each piece's table
    is up to 4 LSB of its own step off, and the sums round), and inputs below
    it read 1/sqrt's top as simulate clips them."""
    model = _Rsqrt()
    x = np.geomspace(1e-3, 10.0, 64, dtype=np.float32)[None]
    variables = model.init(jax.random.key(0), x)
    # verify=False: the held-back perturbations move inputs below zero, where
    # RSQRT is undefined (LiteRT's kernel stops with an error).
    result = odmlq.export_tflite(model, INT16, [x, x], variables=variables, benchmark=False, verify=False)
    graph = result.plan.graph
    in_scale = float(np.max(result.scales.edges[graph.inputs[0]].scale))
    out_scale = float(np.max(result.scales.edges[graph.outputs[0]].scale))
    interpreter = Interpreter(model_content=result.tflite)
    interpreter.allocate_tensors()
    into, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    codes = np.arange(32768 - 32768 % 64).reshape(-1, 64)
    got = []
    for row in codes:
        interpreter.set_tensor(into["index"], (row * np.float32(in_scale)).astype(np.float32)[None])
        interpreter.invoke()
        got.append(np.round(interpreter.get_tensor(out["index"])[0] / np.float32(out_scale)))
    codes, got = codes.reshape(-1), np.concatenate(got)
    with np.errstate(divide="ignore"):
        exact = np.clip(np.round(1.0 / np.sqrt(codes * np.float32(in_scale)) / out_scale), -32768, 32767)
    error = np.abs(got - exact)
    low = int(np.ceil(1e-3 / in_scale))
    assert error[codes >= low].max() <= 5.0
    assert error[codes < low].max() <= 1.0
    # One table over the same scales: thousands of LSB off from the low up.
    assert rsqrt_table_error(in_scale, out_scale, 1e-3)[0] > 1000.0
