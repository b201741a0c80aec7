"""Embedding lookups as models write them: ``table[ids]``, jnp.take's modes, nn.Embed's
'fill', one table or several (`litert/_forms`: gathered_in_fill_mode, gathered_without_fill)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

import odmlq

DYNAMIC = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
INT16 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]


def _invoke(tflite: bytes, *inputs) -> np.ndarray:
    interpreter = Interpreter(model_content=tflite)
    interpreter.allocate_tensors()
    for detail, x in zip(interpreter.get_input_details(), inputs):
        interpreter.set_tensor(detail["index"], x)
    interpreter.invoke()
    out = interpreter.get_output_details()[0]
    scale, zero_point = out["quantization"]
    got = interpreter.get_tensor(out["index"])
    return (got.astype(np.float32) - zero_point) * scale if scale else got


class _IndexedTable(nn.Module):
    """A table read as Flax's sst2 example reads its embedding: ``table[ids]`` (a gather in
    mode 'promise_in_bounds'), or with jnp.take's mode 'clip'."""

    mode: str

    @nn.compact
    def __call__(self, ids):
        table = self.param("table", nn.initializers.normal(0.1), (30, 8))
        rows = table[ids] if self.mode == "index" else jnp.take(table, ids, axis=0, mode=self.mode)
        return nn.Dense(4, name="out")(jnp.tanh(rows))


@pytest.mark.parametrize("mode", ["index", "clip"])
def test_an_int16_table_read_by_index_or_clip_exports_its_rows_for_any_index(mode):
    """litert-converter 0.5.0 makes no int16 GATHER_ND in those modes (refused before); the
    export clamps the indices and gathers in mode 'fill', which it makes. Indices past either
    end read the rows XLA's clamp reads: LiteRT against float within int16 and int8 rounding
    (the model's output is 1e-2 at most; measured 6e-4)."""
    model = _IndexedTable(mode)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 30, size=(1, 5)).astype(np.int32) for _ in range(6)]
    variables = model.init(jax.random.key(0), batches[0])
    result = odmlq.export_tflite(model, INT16, batches, variables=variables, progress=False, benchmark=False)
    assert result.summary.float_islands == () and "GATHER_ND" in result.summary.op_histogram
    assert result.verification.passed, str(result.verification)
    ids = np.array([[31, 29, 0, 1000, 7]], np.int32) if mode == "clip" else np.array([[29, -1, 0, 5, 7]], np.int32)
    got = _invoke(result.tflite, ids)
    np.testing.assert_allclose(got, np.asarray(model.apply(variables, ids)), atol=2e-3)


class _TwoTables(nn.Module):
    """Flax's WMT Transformer's lookups: an encoder's and a decoder's nn.Embed (mode 'fill')."""

    @nn.compact
    def __call__(self, inputs, targets):
        source = nn.Embed(40, 16, name="source")(inputs)
        target = nn.Embed(40, 16, embedding_init=nn.initializers.normal(0.5), name="target")(targets)
        return nn.Dense(8, name="out")(jnp.tanh(source) + target)


@pytest.mark.parametrize("rules", [DYNAMIC, INT8], ids=["dynamic", "int8"])
def test_two_tables_gathered_in_fill_mode_keep_their_own_scales(rules):
    """litert-converter 0.5.0 wrote nn.Embed's fill as a bounds check and a SELECT_V2 of
    the rows and one fill constant shared by both tables, quantized at one table's scale:
    in dynamic range the other table's rows were requantized to it, 1 LSB off, and the
    export refused itself. Each table is now gathered without the fill: its own scale, no
    requantization, no bounds check (6 ops XNNPACK does not run). An index out of bounds
    still fails the invocation, as LiteRT's GATHER_ND read the unchecked index before."""
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 40, size=(1, 6)).astype(np.int32), rng.integers(0, 40, size=(1, 6)).astype(np.int32))
               for _ in range(6)]
    model = _TwoTables()
    variables = model.init(jax.random.key(0), *batches[0])
    result = odmlq.export_tflite(model, rules, batches, variables=variables, progress=False, benchmark=False)
    assert result.verification.passed, str(result.verification)
    ops = result.summary.op_histogram
    assert ops["GATHER_ND"] == 2 and not {"SELECT_V2", "REDUCE_ALL", "GREATER_EQUAL", "LESS_EQUAL"} & set(ops), ops
    assert "QUANTIZE" not in ops or rules is INT8, ops  # the dynamic file requantizes no table's rows
    inputs, targets = batches[0]
    np.testing.assert_allclose(_invoke(result.tflite, inputs, targets),
                               np.asarray(model.apply(variables, inputs, targets)), atol=0.05)
    with pytest.raises(RuntimeError, match="gather_nd index out of bounds"):
        _invoke(result.tflite, np.full_like(inputs, 40), targets)


class _PositionRow(nn.Module):
    """Flax's lm1b and WMT decoders in decode mode: the position embedding's row at the
    cache index (``lax.dynamic_slice`` of a learned table), and a window of an activation."""

    @nn.compact
    def __call__(self, ids):
        table = self.param("pos_embedding", nn.initializers.normal(0.5), (1, 16, 8))
        # Token ids up to 29 as positions into 16 rows, and as the start of a window of 4 of 5
        # positions: XLA clamps a start past the end (to 15 and to 1).
        row = jax.lax.dynamic_slice(table, (0, ids[0, 0], 0), (1, 1, 8))
        h = nn.Dense(8, name="fc")(nn.Embed(30, 8, name="embed")(ids)) + row
        return nn.Dense(4, name="out")(jax.lax.dynamic_slice_in_dim(h, ids[0, 1], 4, axis=1))


def test_a_row_at_a_run_time_position_is_a_slice_of_the_int8_table():
    """``lax.dynamic_slice`` was refused as an op without an integer kernel; it is LiteRT's
    SLICE with a run-time begin, the table's row keeping the table's grid (no QUANTIZE of the
    table at every invocation). Positions past the end read the last row, as XLA clamps."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 30, size=(1, 5)).astype(np.int32) for _ in range(8)]
    model = _PositionRow()
    variables = model.init(jax.random.key(0), batches[0])
    result = odmlq.export_tflite(model, INT8, batches, variables=variables, progress=False, benchmark=False)
    assert result.verification.passed and result.summary.float_islands == (), str(result.verification)
    ops = result.summary.op_histogram
    assert ops["SLICE"] >= 2 and "QUANTIZE" not in ops, ops
    # Within int8 rounding of float (measured 0.012-0.016) in bounds and past either end.
    for ids in ([[3, 0, 0, 5, 7]], [[29, 7, 0, 5, 7]], [[15, 1, 2, 5, 7]]):
        ids = np.array(ids, np.int32)
        np.testing.assert_allclose(_invoke(result.tflite, ids), np.asarray(model.apply(variables, ids)), atol=0.05)
    # int16: the converter would requantize the int8 table at every invocation; refused
    # before any work, naming the op (an int16 window of an activation converts:
    # tests/litert/test_coverage.py).
    with pytest.raises(odmlq.litert.FloatOpsError,
                       match=r"op 'dynamic_slice' \(module 'fc'.*requantizing the whole weight.*int8 activations"):
        odmlq.litert.check_plan(odmlq.plan(model, INT16, batches[0], variables=variables, target="litert"))
