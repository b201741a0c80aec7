"""Tests of `repair.repair_int16_conv_bias` on real litert-converter 0.5.0 output.

Each case is exported the way `odmlq.export_tflite` does it, minus its plan
check (which refuses int16x8 convolutions): plan, calibrate, compute scales,
annotate, convert. The repaired model must compute what `odmlq.simulate`
computes, within 1 LSB, op by op and at its output.
"""

from __future__ import annotations

import copy
import functools
import warnings

import flatbuffers
import flax.linen as nn
import jax
import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter

import odmlq
from odmlq.graph import params_for
from odmlq.litert import _annotate, _convert
from odmlq.litert.verify import verify

from odmlq.litert._repair import (int16_add_sub_problems, int16_conv_bias_problems, repair_int16_add_sub,
                                  repair_int16_conv_bias)

INT16X8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
# 1 LSB, plus float32 noise in comparing int16 values in float (odmlq's own
# verification allows the same 1e-2 at int16).
ALLOWED_LSB = 1.0 + 1e-2


class OneConv(nn.Module):
    features: int = 8
    strides: tuple = (1, 1)
    padding: str = "SAME"
    dilation: tuple = (1, 1)
    groups: int = 1
    relu: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.features, (3, 3), strides=self.strides, padding=self.padding,
                    kernel_dilation=self.dilation, feature_group_count=self.groups, name="conv")(x)
        return nn.relu(y) if self.relu else y


class Tiny(nn.Module):
    """conv 3x3 (bias) -> relu -> conv -> dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), name="conv1")(x))
        x = nn.Conv(4, (3, 3), name="conv2")(x)
        return nn.Dense(5, name="dense")(x.reshape(x.shape[0], -1))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="out")(nn.relu(nn.Dense(16, name="hidden")(x.reshape(x.shape[0], -1))))


# name -> (model, the LiteRT op it becomes)
CASES = {
    "conv": (OneConv(), "CONV_2D"),
    "depthwise": (OneConv(features=4, groups=4), "DEPTHWISE_CONV_2D"),
    "depthwise_multiplier_2": (OneConv(features=8, groups=4), "DEPTHWISE_CONV_2D"),
    "stride2_same": (OneConv(strides=(2, 2), padding="SAME"), "CONV_2D"),
    "dilation2": (OneConv(dilation=(2, 2)), "CONV_2D"),
    "grouped2": (OneConv(features=8, groups=2), "CONV_2D"),
    "conv_relu": (OneConv(relu=True), "CONV_2D"),
    "tiny": (Tiny(), "CONV_2D"),
}
_OP_NAMES = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}


@functools.lru_cache(maxsize=None)
def _export(name: str, rules_name: str = "int16x8", seed: int = 0):
    """(raw .tflite, plan, scales, variables, held-back inputs), check_plan bypassed."""
    model = CASES[name][0] if name in CASES else Mlp()
    rules = {"int16x8": INT16X8, "int8": INT8}[rules_name]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, 10, 10, 4)).astype(np.float32)
    variables = model.init(jax.random.PRNGKey(seed), x[:1])
    # Flax initialises biases to zero; give them values so that a misread bias shows.
    variables = jax.tree_util.tree_map_with_path(
        lambda path, v: (jax.random.normal(jax.random.PRNGKey(seed + 1), v.shape) * 0.5
                         if "bias" in jax.tree_util.keystr(path) else v), variables)
    plan = odmlq.plan(model, rules, x[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, [x[:32]], variables=variables)
    params = params_for(model, variables, "test")
    scales = odmlq.compute_scales(plan, calibration, params)
    fn = _annotate.annotated_function(plan.graph, plan, scales, params).fn
    tflite = _convert.convert(fn, (x[:1],), input_names=["x"], output_names=["output_0"])
    return tflite, plan, scales, variables, x[32:]


def _model(tflite: bytes) -> schema.ModelT:
    return schema.ModelT.InitFromPackedBuf(bytearray(tflite), 0)


def _pack(model: schema.ModelT) -> bytes:
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _op_name(model: schema.ModelT, op: schema.OperatorT) -> str:
    code = model.operatorCodes[op.opcodeIndex]
    return _OP_NAMES[max(code.builtinCode, code.deprecatedBuiltinCode)]


def _interpreter(tflite: bytes, **kwargs) -> Interpreter:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_content=tflite, **kwargs)
    interpreter.allocate_tensors()
    return interpreter


def _output_max_lsb(tflite: bytes, name: str) -> float:
    """Largest difference, in LSBs of the output, between LiteRT and odmlq.simulate."""
    _, plan, scales, variables, x = _export(name)
    model = CASES[name][0]
    interpreter = _interpreter(tflite, num_threads=1)
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    scale = float(np.asarray(scales.edges[plan.graph.outputs[0]].scale).reshape(-1)[0])
    worst = 0.0
    for row in x:
        interpreter.set_tensor(inp["index"], row[None])
        interpreter.invoke()
        expected = np.asarray(odmlq.simulate(model, plan, scales, row[None], variables=variables))
        worst = max(worst, float(np.max(np.abs(interpreter.get_tensor(out["index"]) - expected))) / scale)
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_converter_output_is_broken_without_the_repair(name):
    """What the repair is for; when this fails, litert-converter has been fixed."""
    tflite = _export(name)[0]
    assert int16_conv_bias_problems(tflite)
    if CASES[name][1] == "DEPTHWISE_CONV_2D":
        with pytest.raises(RuntimeError, match="bias->type != kTfLiteInt64"):
            _interpreter(tflite)
    else:
        assert _output_max_lsb(tflite, name) > 1000


@pytest.mark.parametrize("name", list(CASES))
def test_repaired_ops_are_within_one_lsb_of_simulate(name):
    tflite, plan, scales, variables, x = _export(name)
    repaired = repair_int16_conv_bias(tflite)
    assert not int16_conv_bias_problems(repaired)
    # Every op fed LiteRT's own inputs (odmlq's verification), scales checked too.
    report = verify(repaired, CASES[name][0], plan, scales, [x], variables=variables)
    assert report.passed and not report.unmapped_edges
    assert all(c.max_lsb <= ALLOWED_LSB for c in report.checks), str(report)
    kinds = [_op_name(_model(repaired), op) for op in _model(repaired).subgraphs[0].operators]
    assert CASES[name][1] in kinds


@pytest.mark.parametrize("name", [n for n in CASES if n != "tiny"])
def test_repaired_outputs_are_within_one_lsb_of_simulate(name):
    """Single-op models: the output is the convolution's, against simulate end to end."""
    assert _output_max_lsb(repair_int16_conv_bias(_export(name)[0]), name) <= ALLOWED_LSB


def test_two_convolutions_end_to_end():
    """conv -> relu -> conv -> dense: each op within 1 LSB (above); end to end the
    one-LSB differences of the first conv may add one more, never more."""
    assert _output_max_lsb(repair_int16_conv_bias(_export("tiny")[0]), "tiny") <= 2 * ALLOWED_LSB


@pytest.mark.parametrize("name", ["conv", "depthwise", "tiny"])
def test_repair_changes_only_the_bias(name):
    raw = _export(name)[0]
    before, after = _model(raw), _model(repair_int16_conv_bias(raw))
    biases = set()
    for op_before, op_after in zip(before.subgraphs[0].operators, after.subgraphs[0].operators):
        assert list(op_before.inputs) == list(op_after.inputs)
        if _op_name(before, op_before) in ("CONV_2D", "DEPTHWISE_CONV_2D"):
            biases.add(int(op_before.inputs[2]))
    assert biases
    graph_before, graph_after = before.subgraphs[0], after.subgraphs[0]
    assert len(graph_before.tensors) == len(graph_after.tensors)
    assert len(before.buffers) == len(after.buffers)
    for i, (t0, t1) in enumerate(zip(graph_before.tensors, graph_after.tensors)):
        b0, b1 = before.buffers[t0.buffer].data, after.buffers[t1.buffer].data
        assert (t0.name, list(t0.shape), t0.buffer) == (t1.name, list(t1.shape), t1.buffer)
        q0, q1 = t0.quantization, t1.quantization
        assert (q0 is None) == (q1 is None)
        if q0 is not None and q0.scale is not None:
            np.testing.assert_array_equal(q0.scale, q1.scale)
            np.testing.assert_array_equal(q0.zeroPoint, q1.zeroPoint)
            assert q0.quantizedDimension == q1.quantizedDimension
        if i in biases:
            assert (t0.type, t1.type) == (schema.TensorType.INT32, schema.TensorType.INT64)
            assert not np.any(q1.zeroPoint)
            np.testing.assert_array_equal(np.frombuffer(bytes(b0), "<i4").astype(np.int64),
                                          np.frombuffer(bytes(b1), "<i8"))
        else:
            assert t0.type == t1.type
            assert (b0 is None and b1 is None) or bytes(b0) == bytes(b1)
    # Operator codes, options, signature and metadata come through unchanged.
    assert [vars(c) for c in before.operatorCodes] == [vars(c) for c in after.operatorCodes]
    for op0, op1 in zip(graph_before.operators, graph_after.operators):
        options = (op0.builtinOptions, op1.builtinOptions)
        assert [None if o is None else vars(o) for o in options][0] == \
            [None if o is None else vars(o) for o in options][1]
    assert [(m.name, m.buffer) for m in before.metadata] == [(m.name, m.buffer) for m in after.metadata]
    assert len(before.signatureDefs) == len(after.signatureDefs) == 1


def test_repaired_model_runs_in_both_interpreter_modes_and_xnnpack_takes_nothing():
    repaired = repair_int16_conv_bias(_export("tiny")[0])
    for kwargs in ({}, {"experimental_preserve_all_tensors": True}):
        interpreter = _interpreter(repaired, **kwargs)
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], _export("tiny")[4][:1])
        interpreter.invoke()
        # XNNPACK has no int16 convolution: no DELEGATE node, every op runs in LiteRT's kernels.
        assert "DELEGATE" not in [d["op_name"] for d in interpreter._get_ops_details()]


@pytest.mark.parametrize("name,rules", [("conv", "int8"), ("depthwise", "int8"), ("mlp", "int16x8")])
def test_model_without_int16_convolutions_is_returned_unchanged(name, rules):
    tflite = _export(name, rules)[0]
    assert not int16_conv_bias_problems(tflite)
    assert repair_int16_conv_bias(tflite) == tflite


def test_repair_is_idempotent():
    once = repair_int16_conv_bias(_export("grouped2")[0])
    assert repair_int16_conv_bias(once) == once


def _run_all_outputs(tflite: bytes, x: np.ndarray) -> list[np.ndarray]:
    interpreter = _interpreter(tflite, num_threads=1)
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    return [interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()]


def test_bias_buffer_shared_with_another_tensor_is_copied():
    """A buffer the converter shares between the bias and another int32 tensor:
    the other tensor keeps its int32 data."""
    tflite, *_, x = _export("conv")
    model = _model(tflite)
    graph = model.subgraphs[0]
    conv = next(op for op in graph.operators if _op_name(model, op) == "CONV_2D")
    bias = graph.tensors[conv.inputs[2]]
    other = copy.deepcopy(bias)
    other.name = b"another_reader_of_the_bias_buffer"
    graph.tensors.append(other)
    graph.outputs = np.append(graph.outputs, len(graph.tensors) - 1).astype(np.int32)
    shared = _pack(model)

    repaired = _model(repair_int16_conv_bias(shared))
    new_bias = repaired.subgraphs[0].tensors[conv.inputs[2]]
    new_other = repaired.subgraphs[0].tensors[-1]
    assert new_bias.type == schema.TensorType.INT64 and new_other.type == schema.TensorType.INT32
    assert new_bias.buffer != new_other.buffer == bias.buffer
    assert bytes(repaired.buffers[new_other.buffer].data) == bytes(model.buffers[bias.buffer].data)
    expected = _run_all_outputs(repair_int16_conv_bias(tflite), x[:1])[0]
    got = _run_all_outputs(_pack(repaired), x[:1])
    np.testing.assert_array_equal(got[0], expected)
    np.testing.assert_array_equal(got[1], np.frombuffer(bytes(model.buffers[bias.buffer].data), "<i4"))


def test_bias_tensor_read_elsewhere_is_duplicated_for_the_convolution():
    """The bias tensor itself is also a model output: it stays int32 there."""
    tflite, *_, x = _export("conv")
    model = _model(tflite)
    graph = model.subgraphs[0]
    conv = next(op for op in graph.operators if _op_name(model, op) == "CONV_2D")
    bias_index = int(conv.inputs[2])
    graph.outputs = np.append(graph.outputs, bias_index).astype(np.int32)
    repaired = _model(repair_int16_conv_bias(_pack(model)))
    graph_after = repaired.subgraphs[0]
    conv_after = next(op for op in graph_after.operators if _op_name(repaired, op) == "CONV_2D")
    assert int(conv_after.inputs[2]) == len(graph_after.tensors) - 1 != bias_index
    assert graph_after.tensors[bias_index].type == schema.TensorType.INT32
    assert graph_after.tensors[conv_after.inputs[2]].type == schema.TensorType.INT64
    got = _run_all_outputs(_pack(repaired), x[:1])
    np.testing.assert_array_equal(got[0], _run_all_outputs(repair_int16_conv_bias(tflite), x[:1])[0])


def test_two_convolutions_sharing_one_bias_tensor_get_one_int64_tensor():
    tflite, *_, x = _export("conv")
    model = _model(tflite)
    graph = model.subgraphs[0]
    conv_at = next(i for i, op in enumerate(graph.operators) if _op_name(model, op) == "CONV_2D")
    conv = graph.operators[conv_at]
    twin = copy.deepcopy(conv)
    graph.tensors.append(copy.deepcopy(graph.tensors[conv.outputs[0]]))
    twin.outputs = np.array([len(graph.tensors) - 1], np.int32)
    graph.operators.insert(conv_at + 1, twin)
    graph.outputs = np.append(graph.outputs, len(graph.tensors) - 1).astype(np.int32)
    tensors_before, buffers_before = len(graph.tensors), len(model.buffers)
    repaired = _model(repair_int16_conv_bias(_pack(model)))
    graph_after = repaired.subgraphs[0]
    convs = [op for op in graph_after.operators if _op_name(repaired, op) == "CONV_2D"]
    assert len({int(op.inputs[2]) for op in convs}) == 1
    assert (len(graph_after.tensors), len(repaired.buffers)) == (tensors_before, buffers_before)
    # The twin writes an extra model output; the original's int16 result feeds the DEQUANTIZE.
    interpreter = _interpreter(_pack(repaired), experimental_preserve_all_tensors=True)
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x[:1])
    interpreter.invoke()
    first, second = (interpreter.get_tensor(int(op.outputs[0])) for op in convs)
    assert first.dtype == np.int16
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(interpreter.get_tensor(interpreter.get_output_details()[0]["index"]),
                                  _run_all_outputs(repair_int16_conv_bias(tflite), x[:1])[0])


def _tree(value):
    """A flatbuffer object (ModelT and everything under it) as plain, comparable values."""
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.tobytes())
    if isinstance(value, (list, tuple)):
        return [_tree(v) for v in value]
    if hasattr(value, "__dict__"):
        return (type(value).__name__, {k: _tree(v) for k, v in vars(value).items()})
    return value


@pytest.mark.parametrize("name", ["tiny", "depthwise", "grouped2"])
def test_undoing_the_repair_gives_the_original_model(name):
    """Field by field, the repaired model is the converter's but for the bias type and bytes."""
    raw = _export(name)[0]
    repaired = _model(repair_int16_conv_bias(raw))
    graph = repaired.subgraphs[0]
    undone = 0
    for tensor in graph.tensors:
        if tensor.type == schema.TensorType.INT64:
            buffer = repaired.buffers[tensor.buffer]
            values = np.frombuffer(bytes(buffer.data), "<i8")
            assert np.all(np.abs(values) < 2**31)
            buffer.data = np.frombuffer(values.astype("<i4").tobytes(), np.uint8)
            tensor.type = schema.TensorType.INT32
            undone += 1
    assert undone == len(int16_conv_bias_problems(raw))
    assert _tree(repaired) == _tree(_model(raw))


def _conv_options(tflite: bytes) -> list[tuple[str, int, int]]:
    """(op, bias tensor type, declared quantized_bias_type) of each convolution."""
    model = _model(tflite)
    graph = model.subgraphs[0]
    return [(_op_name(model, op), graph.tensors[op.inputs[2]].type,
             getattr(op.builtinOptions, "quantizedBiasType", None))
            for op in graph.operators if _op_name(model, op) in ("CONV_2D", "DEPTHWISE_CONV_2D")]


@pytest.mark.parametrize("name", list(CASES))
def test_int32_bias_when_exact_is_within_one_lsb(name):
    tflite, plan, scales, variables, x = _export(name)
    fast = repair_int16_conv_bias(tflite, int32_bias_when_exact=True)
    T = schema.TensorType
    for kind, bias_type, declared in _conv_options(fast):
        # These small convolutions cannot overflow: every CONV_2D keeps a declared int32 bias.
        expected = (T.INT32, T.INT32) if kind == "CONV_2D" else (T.INT64, None)
        assert (bias_type, declared) == expected
    report = verify(fast, CASES[name][0], plan, scales, [x], variables=variables)
    assert all(c.max_lsb <= ALLOWED_LSB for c in report.checks), str(report)


def test_int32_bias_is_not_kept_where_the_int32_accumulator_could_overflow():
    """A 3x3x64 convolution with every weight at 127 and inputs at full scale sums
    9 * 64 * 32767 * 127 = 2.4e9 > 2**31: LiteRT's int32 kernel would wrap
    (measured: 59162 LSB off), so the int64 bias (reference kernel) is kept."""
    model = OneConv(features=8, padding="VALID")
    cin = 64
    x = (np.abs(np.random.default_rng(0).normal(size=(16, 6, 6, cin))) * 0.01 + 3.0).astype(np.float32)
    variables = {"params": {"conv": {"kernel": np.full((3, 3, cin, 8), 0.1, np.float32),
                                     "bias": np.full((8,), 0.5, np.float32)}}}
    plan = odmlq.plan(model, INT16X8, x[:1], variables=variables)
    scales = odmlq.compute_scales(plan, odmlq.calibrate(model, plan, [x[:8]], variables=variables),
                                  variables)
    fn = _annotate.annotated_function(plan.graph, plan, scales, variables).fn
    tflite = _convert.convert(fn, (x[:1],), input_names=["x"], output_names=["y"])
    fast = repair_int16_conv_bias(tflite, int32_bias_when_exact=True)
    assert _conv_options(fast) == [("CONV_2D", schema.TensorType.INT64, schema.TensorType.FLOAT32)]
    report = verify(fast, model, plan, scales, [x[8:]], variables=variables)
    assert all(c.max_lsb <= ALLOWED_LSB for c in report.checks), str(report)


class Unmasked(nn.Module):
    """``1 - m`` for a 0/1 mask: int16 scales 2**-14 (the constant) and 1/32767
    (the mask, and the result), which LiteRT takes for powers of two."""

    def __call__(self, m):
        return 1.0 - m


def _unmasked_export():
    model = Unmasked()
    m = (np.random.default_rng(0).random((40, 8)) > 0.3).astype(np.float32)
    plan = odmlq.plan(model, INT16X8, m[:1], variables={})
    scales = odmlq.compute_scales(plan, odmlq.calibrate(model, plan, [m[:32]], variables={}), {})
    fn = _annotate.annotated_function(plan.graph, plan, scales, {}).fn
    tflite = _convert.convert(fn, (m[:1],), input_names=["m"], output_names=["output_0"])
    return tflite, model, plan, scales, m[32:]


def test_int16_sub_on_the_power_of_two_path_is_refused_without_the_repair():
    """What `repair_int16_add_sub` is for; when this fails, the converter clears
    ``pot_scale_int16`` itself."""
    tflite = _unmasked_export()[0]
    (problem,) = int16_add_sub_problems(tflite)
    assert "(SUB)" in problem
    with pytest.raises(RuntimeError, match="input1_shift <= 0"):
        _interpreter(tflite)


def test_repaired_int16_sub_takes_the_general_path_and_matches_simulate():
    tflite, model, plan, scales, m = _unmasked_export()
    repaired = repair_int16_add_sub(tflite)
    assert not int16_add_sub_problems(repaired)
    assert repair_int16_add_sub(repaired) is repaired  # nothing left to do: the same bytes
    report = verify(repaired, model, plan, scales, [m], variables={})
    assert report.passed and report.output_max_lsb == 0, str(report)
    # Only the option changed: the same ops, tensors and buffers.
    before, after = _model(tflite), _model(repaired)
    assert [_op_name(before, op) for op in before.subgraphs[0].operators] == \
        [_op_name(after, op) for op in after.subgraphs[0].operators]
    assert len(before.subgraphs[0].tensors) == len(after.subgraphs[0].tensors)
