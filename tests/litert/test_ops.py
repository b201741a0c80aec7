"""Every op kind a model is built from, exported full-integer int8 and verified.

One small Linen model per op: calibrated on a few random batches, exported
with one int8 rule, then checked for the LiteRT kernel it should become, no
float islands, every edge within 1 LSB of `simulate` (LiteRT's integer
kernels may round a half step the other way) and int8 weights and constants
in the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
import odmlq.litert
from odmlq.litert import FloatOpsError

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _Fn(nn.Module):
    """`fn(x)`, after a Dense unless `dense_first` is False (so the op sees a
    general, signed activation)."""

    fn: Callable
    features: int = 8
    dense_first: bool = True

    @nn.compact
    def __call__(self, x):
        if self.dense_first:
            x = nn.Dense(self.features, name="fc")(x)
        return self.fn(x)


class _Einsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 12))
        return jnp.einsum("btd,df->btf", x, kernel)


class _BatchMatmul(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = nn.Dense(8, name="a")(x)
        b = nn.Dense(8, name="b")(x)
        return jnp.einsum("bij,bjk->bik", a, b)


class _Conv(nn.Module):
    features: int = 8
    kernel_size: tuple = (3, 3)
    strides: tuple = (1, 1)
    padding: str = "SAME"
    kernel_dilation: tuple = (1, 1)
    feature_group_count: int = 1

    @nn.compact
    def __call__(self, x):
        return nn.Conv(self.features, self.kernel_size, strides=self.strides, padding=self.padding,
                       kernel_dilation=self.kernel_dilation,
                       feature_group_count=self.feature_group_count, name="conv")(x)


class _BiasAdd(nn.Module):
    """A bias parameter added to an activation that is not a matmul's output."""

    @nn.compact
    def __call__(self, x):
        bias = self.param("bias", nn.initializers.normal(1.0), (x.shape[-1],))
        return nn.Dense(8, name="fc")(nn.relu(x) + bias)


class _Residual(nn.Module):
    op: Callable = jnp.add

    @nn.compact
    def __call__(self, x):
        return self.op(x, nn.Dense(x.shape[-1], name="fc")(x))


class _BroadcastResidual(nn.Module):
    """(b, 4, 8) + (b, 1, 8): a residual broadcast over one axis."""

    op: Callable = jnp.add

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(8, name="fc")(x)
        return self.op(y, jnp.mean(x, axis=1, keepdims=True))


class _Concat(nn.Module):
    with_input: bool = False  # the input also feeds the Denses: it is requantized

    @nn.compact
    def __call__(self, x):
        a = nn.Dense(6, name="a")(x)
        b = nn.sigmoid(nn.Dense(4, name="b")(x))  # a fixed output scale, requantized too
        return jnp.concatenate([a, b, x] if self.with_input else [a, b], axis=-1)


class _Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(8, name=n)(x) for n in "qkv")
        weights = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) * 0.35)
        return jnp.einsum("bqk,bkd->bqd", weights, v)


@dataclasses.dataclass(frozen=True)
class Case:
    model: nn.Module
    shape: tuple[int, ...]  # one sample's input shape
    expected_op: str | tuple[str, ...]  # the LiteRT op(s) it must become
    input_scale: float = 1.0  # of the standard normal calibration inputs


_SCALE = np.array([0.5, -1.0, 2.0, 0.25, 1.5, -0.75, 3.0, 1.0], np.float32)

CASES = {
    "dense": Case(_Fn(lambda x: x, features=16), (12,), "FULLY_CONNECTED"),
    "einsum_weight": Case(_Einsum(), (5, 8), "FULLY_CONNECTED"),
    "einsum_batch_matmul": Case(_BatchMatmul(), (8, 6), "BATCH_MATMUL"),
    "conv_stride2_same": Case(_Conv(strides=(2, 2)), (9, 9, 3), "CONV_2D"),
    "conv_valid": Case(_Conv(padding="VALID"), (8, 8, 3), "CONV_2D"),
    "conv_dilated": Case(_Conv(kernel_dilation=(2, 2)), (10, 10, 3), "CONV_2D"),
    "conv_grouped": Case(_Conv(features=8, feature_group_count=2), (8, 8, 4), "CONV_2D"),
    "conv_depthwise_multiplier2": Case(_Conv(features=8, feature_group_count=4), (8, 8, 4),
                                       "DEPTHWISE_CONV_2D"),
    "bias_add": Case(_BiasAdd(), (8,), "ADD"),
    "relu": Case(_Fn(nn.relu, dense_first=False), (8,), "RELU"),
    "relu6": Case(_Fn(nn.relu6, dense_first=False), (8,), "RELU6", input_scale=4.0),
    "relu6_fused_into_mul": Case(_Fn(lambda x: nn.relu6(x * 4.0)), (8,), "MUL"),
    "sigmoid": Case(_Fn(nn.sigmoid), (8,), "LOGISTIC"),
    "tanh": Case(_Fn(jnp.tanh), (8,), "TANH"),
    # Its ADD (RELU6 fused), MUL by 1/6 and MUL: XNNPACK runs no int8 HARD_SWISH.
    "hard_swish": Case(_Fn(jax.nn.hard_swish), (8,), ("ADD", "MUL")),
    "hard_swish_written_out": Case(_Fn(lambda x: x * nn.relu6(x + 3.0) / 6.0), (8,), ("ADD", "MUL")),
    # MobileNetV3's gate: ADD (RELU6 fused) and a MUL by 1/6, all XNNPACK's.
    "hard_sigmoid": Case(_Fn(jax.nn.hard_sigmoid), (8,), ("ADD", "MUL"), input_scale=3.0),
    # A pixel shuffle (depth to space) through 6 axes: the 6-axis edges move integers unmarked.
    "pixel_shuffle": Case(_Fn(lambda x: x.reshape(x.shape[0], 4, 5, 2, 2, 2).transpose(0, 1, 3, 2, 4, 5)
                              .reshape(x.shape[0], 8, 10, 2), features=8), (4, 5, 3), "TRANSPOSE"),
    "gelu_tanh": Case(_Fn(lambda x: jax.nn.gelu(x, approximate=True)), (8,), "GELU"),
    "gelu_exact": Case(_Fn(lambda x: jax.nn.gelu(x, approximate=False)), (8,), "GELU"),
    # Unpadded: a depthwise convolution with weights 1/4, which XNNPACK takes
    # (it does not take int8 AVERAGE_POOL_2D).
    "avg_pool": Case(_Fn(lambda x: nn.avg_pool(x, (2, 2), strides=(2, 2)), features=4), (6, 6, 3),
                     "DEPTHWISE_CONV_2D"),
    "avg_pool_same_padding": Case(
        _Fn(lambda x: nn.avg_pool(x, (3, 3), strides=(2, 2), padding="SAME", count_include_pad=False),
            features=4), (6, 6, 3), "AVERAGE_POOL_2D"),
    "max_pool": Case(_Fn(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), features=4), (6, 6, 3),
                     "MAX_POOL_2D"),
    "add_residual": Case(_Residual(jnp.add), (8,), "ADD"),
    "sub_residual": Case(_Residual(jnp.subtract), (8,), "SUB"),
    "mul_activations": Case(_Residual(jnp.multiply), (8,), "MUL"),
    "add_broadcast": Case(_BroadcastResidual(jnp.add), (4, 8), "ADD"),
    "mul_broadcast": Case(_BroadcastResidual(jnp.multiply), (4, 8), "MUL"),
    "mul_scalar": Case(_Fn(lambda x: x * 0.3), (8,), "MUL"),
    "add_scalar": Case(_Fn(lambda x: x + 1.0), (8,), "ADD"),
    "mul_broadcast_constant": Case(_Fn(lambda x: x * _SCALE), (8,), "MUL"),
    "concatenate": Case(_Concat(), (8,), "CONCATENATION"),
    "concatenate_with_input": Case(_Concat(with_input=True), (8,), ("CONCATENATION", "LOGISTIC")),
    "flatten": Case(_Fn(lambda x: x.reshape((x.shape[0], -1)), features=4), (3, 5), "RESHAPE"),
    "transpose": Case(_Fn(lambda x: jnp.transpose(x, (0, 2, 1)), features=4), (3, 5), "TRANSPOSE"),
    "flip": Case(_Fn(lambda x: jnp.flip(x, axis=1), features=4), (3, 5), "REVERSE_V2"),
    "mean": Case(_Fn(lambda x: jnp.mean(x, axis=1), features=4), (6, 5), "MEAN"),
    "square": Case(_Fn(jnp.square), (8,), "MUL"),
    "rsqrt": Case(_Fn(lambda x: jax.lax.rsqrt(x * x + 1.0)), (8,), "RSQRT"),
    "sqrt": Case(_Fn(lambda x: jnp.sqrt(x * x + 1.0)), (8,), "SQRT"),
    "softmax": Case(_Fn(jax.nn.softmax), (8,), "SOFTMAX"),
    "attention": Case(_Attention(), (5, 8), ("BATCH_MATMUL", "MUL", "SOFTMAX")),
    # XNNPACK has no integer DIV: a division by a constant is a MUL by its reciprocal.
    "div_by_constant": Case(_Fn(lambda x: x / 3.0), (8,), "MUL"),
    "div": Case(_Fn(lambda x: x / (x * x + 1.0)), (8,), "DIV"),
    "clip": Case(_Fn(lambda x: jnp.clip(x, -0.5, 0.75)), (8,), ("MAXIMUM", "MINIMUM")),
    "pad": Case(_Fn(lambda x: jnp.pad(x, ((0, 0), (1, 2), (0, 0))), features=4), (3, 5), "PAD"),
    "exp": Case(_Fn(jnp.exp), (8,), "EXP"),
    "log": Case(_Fn(lambda x: jnp.log(x * x + 1.0)), (8,), "LOG"),
    "abs": Case(_Fn(jnp.abs), (8,), "ABS"),
    "leaky_relu": Case(_Fn(nn.leaky_relu), (8,), "LEAKY_RELU"),
    "split": Case(_Fn(lambda x: sum(jnp.split(x, 2, axis=-1))), (8,), "SLICE"),
    # Flax's default average pool counts its padding: PAD (zeros) + a VALID
    # pool, here a depthwise convolution (the PAD folded into its padding).
    "avg_pool_counts_padding": Case(
        _Fn(lambda x: nn.avg_pool(x, (3, 3), strides=(1, 1), padding="SAME"), features=4), (6, 6, 3),
        "DEPTHWISE_CONV_2D"),
    "reduce_max": Case(_Fn(lambda x: jnp.max(x, axis=-1)), (4, 8), "REDUCE_MAX"),
    "reduce_min": Case(_Fn(lambda x: jnp.min(x, axis=-1)), (4, 8), "REDUCE_MIN"),
    # Interpolation matrices: int8 constants read as FULLY_CONNECTED weights.
    "resize_bilinear": Case(_Fn(lambda x: jax.image.resize(x, (x.shape[0], 12, 10, 4), "bilinear"),
                                features=4), (6, 5, 3), ("FULLY_CONNECTED", "TRANSPOSE")),
    # By integer factors: copies (`graph/_canonical`); by others, a gather.
    "resize_nearest": Case(_Fn(lambda x: jax.image.resize(x, (x.shape[0], 12, 10, 4), "nearest"),
                               features=4), (6, 5, 3), ("CONCATENATION", "RESHAPE")),
    "resize_nearest_by_3_2": Case(_Fn(lambda x: jax.image.resize(x, (x.shape[0], 9, 5, 4), "nearest"),
                                      features=4), (6, 5, 3), "GATHER_ND"),
}


def _batches(shape, scale=1.0, n=3, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(scale * rng.normal(size=(batch, *shape))).astype(np.float32) for _ in range(n)]


def _export(name):
    case = CASES[name]
    batches = _batches(case.shape, case.input_scale)
    variables = case.model.init(jax.random.key(0), batches[0][:1])
    return name, case, odmlq.export_tflite(case.model, INT8, batches, variables=variables)


@pytest.fixture(params=sorted(CASES), scope="module")
def exported(request):
    return _export(request.param)


def test_becomes_the_expected_integer_kernel(exported):
    name, case, result = exported
    expected = (case.expected_op,) if isinstance(case.expected_op, str) else case.expected_op
    assert set(expected) <= set(result.summary.op_histogram), result.summary.op_histogram
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]


def test_every_edge_verified_within_one_lsb(exported):
    _, _, result = exported
    report = result.verification
    # A multi-output op's outputs (fc/split:0) become tensors named by the op's
    # scope alone, the converter may move a transpose into the matmul around it
    # (resize), and it merges a reshape read only by another reshape (a nearest
    # resize's copies along two axes): they are checked through their consumers
    # and end to end.
    graph = result.plan.graph

    def merged(e):
        readers = [op for op in graph.ops if e in op.inputs]
        return graph.op(graph.edges[e].producer).kind == "reshape" and readers and all(
            op.kind == "reshape" for op in readers)

    assert report.passed and all(":" in e or graph.op(graph.edges[e].producer).kind == "transpose" or merged(e)
                                 for e in report.unmapped_edges), str(report)
    for check in report.checks:
        assert check.params_match, check.edge
        # 1 LSB: an integer kernel may round a half step the other way.
        assert check.max_lsb <= 1.0 + 1e-3, (check.edge, check.max_lsb)


def test_weights_and_constants_are_int8_in_the_flatbuffer(exported):
    _, _, result = exported
    constants = [t for t in result.summary.tensors if t.is_constant]
    for path in result.scales.weights:
        stored = [t for t in constants if path in t.name and t.dtype != "int32"]
        assert stored and all(t.dtype == "int8" for t in stored), (path, stored)
    # Constant operands (x * 0.3, clip bounds) are int8 tensors too; int32 are
    # biases, shapes, paddings and axes.
    assert [(t.name, t.dtype) for t in constants if t.dtype not in ("int8", "int32")] == []


@pytest.mark.parametrize("approximate", [True, False], ids=["tanh", "exact"])
def test_gelu_kernel_computes_the_traced_form(approximate):
    """jax.nn.gelu's tanh form is matched by the converter; the exact form is
    handed over as a `tfl.gelu` composite. Both are one GELU whose option says
    which (its outputs differ by less than 1 LSB, so verification cannot)."""
    from ai_edge_litert import schema_py_generated as schema

    _, _, result = _export(f"gelu_{'tanh' if approximate else 'exact'}")
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(result.tflite, 0))
    gelus = [op for op in model.subgraphs[0].operators
             if model.operatorCodes[op.opcodeIndex].builtinCode == schema.BuiltinOperator.GELU]
    assert [op.builtinOptions.approximate for op in gelus] == [approximate]


def _windows(x):
    """Rows 3-4 and 0-1 of axis 1, as one gather of windows of two."""
    numbers = jax.lax.GatherDimensionNumbers(offset_dims=(0, 2, 3), collapsed_slice_dims=(), start_index_map=(1,))
    return jax.lax.gather(x, jnp.asarray([[3], [0]]), numbers, (x.shape[0], 2, x.shape[2]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


_REFUSED = {
    # GREATER and ARG_MAX run on dequantized values (litert-converter 0.5.0, measured).
    "where": (_Fn(lambda x: jnp.where(x > 0, x, 0.1 * x)), (8,), "int8",
              r"op 'fc/gt' .* reads quantized 'fc/dot_general' and writes bool"),
    "argmax": (_Fn(lambda x: jnp.argmax(x, axis=-1)), (8,), "int8",
               r"op 'fc/argmax' .* writes int32; LiteRT has no integer kernel for 'argmax'"),
    # Windows of two rows: not whole rows (those are a one-hot int16 matmul, tests/litert/test_int16_gathers.py).
    "gather_windows_int16": (_Fn(_windows, features=4), (6, 3), "int16",
                             r"op 'fc/gather' .* no int16 GATHER_ND of an activation other than whole rows"),
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_ops_without_an_integer_kernel_are_refused_before_work_and_run_in_float_when_allowed(name):
    """Refused by the plan check (before calibration and conversion), naming
    op, module and the option; with allow_float_ops=True they export and verify."""
    model, shape, qtype, message = _REFUSED[name]
    batches = _batches(shape)
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=qtype)]
    plan = odmlq.plan(model, rules, batches[0], variables=variables)
    with pytest.raises(FloatOpsError, match=message + r".*allow_float_ops=True"):
        odmlq.litert.check_plan(plan)
    result = odmlq.export_tflite(model, rules, batches, variables=variables, allow_float_ops=True)
    assert result.verification.passed, str(result.verification)


def test_softmax_over_another_axis_is_refused_before_work():
    model = _Fn(lambda x: jax.nn.softmax(x, axis=1), features=4)
    batches = _batches((3, 5))
    variables = model.init(jax.random.key(0), batches[0][:1])
    with pytest.raises(FloatOpsError, match=r"op 'fc/softmax' .* LiteRT's SOFTMAX normalizes the last "
                                            r"axis; this softmax is over axis 1 of a 3-d tensor.*jnp.moveaxis"):
        odmlq.export_tflite(model, INT8, batches, variables=variables)


@pytest.mark.parametrize("name, message", [
    ("log", r"op 'fc/log' .* no int16 kernel for 'log'"),
], ids=["log"])
def test_int16_ops_the_converter_rejects_are_refused_before_work(name, message):
    case = CASES[name]
    batches = _batches(case.shape)
    variables = case.model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    with pytest.raises(FloatOpsError, match=message):
        odmlq.export_tflite(case.model, rules, batches, variables=variables)


@pytest.mark.parametrize("name", ["add_scalar", "bias_add", "mul_broadcast_constant"])
def test_int16_elementwise_ops_read_constants_and_weights_as_int16(name):
    """litert-converter takes an int16 ADD only of operands of one shape and an
    int16 MUL only of int16 operands: a scalar constant or a weight is read
    as an int16 constant stored at the output's shape (`WeightPlan.read_as`),
    and the op verifies within 1 LSB."""
    case = CASES[name]
    batches = _batches(case.shape)
    variables = case.model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    result = odmlq.export_tflite(case.model, rules, batches, variables=variables)
    assert case.expected_op in result.summary.op_histogram and result.summary.float_islands == ()
    assert result.verification.passed, str(result.verification)
    assert all(c.allowed_lsb == pytest.approx(1.01) for c in result.verification.checks)
    op = next(o for o in result.plan.graph.ops if o.kind == case.expected_op.lower())
    op_plan = result.plan.ops[op.id]
    read = [w.read_as for w in op_plan.weights] + list(op_plan.constants)
    assert read and all(r is not None and r.qtype == "int16" for r in read)
    assert all(w.spec is None for w in op_plan.weights)  # the parameter is not stored as int8


class _Embedding(nn.Module):
    @nn.compact
    def __call__(self, ids):
        table = self.param("table", nn.initializers.normal(1.0), (30, 8))
        return nn.Dense(4, name="fc")(jnp.take(table, ids, axis=0, mode="clip"))


def test_embedding_lookup_is_an_int8_gather():
    model = _Embedding()
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 30, size=(8, 5)).astype(np.int32) for _ in range(3)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    result = odmlq.export_tflite(model, INT8, batches, variables=variables)
    ops = result.summary.op_histogram
    assert "GATHER_ND" in ops or "GATHER" in ops, ops
    assert result.summary.float_islands == ()
    assert result.verification.passed and not result.verification.unmapped_edges, str(result.verification)
    table = [t for t in result.summary.tensors if t.is_constant and "table" in t.name]
    assert table and all(t.dtype == "int8" for t in table)
    # The gathered rows keep the table's scale: given their own calibrated
    # scale, litert-converter requantized the whole table (a QUANTIZE of the
    # constant) at every invoke.
    assert "QUANTIZE" not in ops, ops
    rows = result.scales.edges[next(o for o in result.plan.graph.ops if o.kind == "gather").outputs[0]]
    np.testing.assert_array_equal(rows.scale.reshape(-1), result.scales.weights["table"].scale.reshape(-1))


@pytest.mark.parametrize("axis", [0, 1])
def test_a_table_gathered_per_channel_into_a_quantized_edge_is_refused_before_work(axis):
    """GATHER_ND writes its rows at the table's one scale; a per-channel table
    used to crash in the annotation (a bare ValueError)."""
    model = _Embedding()
    batches = [np.random.default_rng(0).integers(0, 30, size=(8, 5)).astype(np.int32)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", weight_granularity=odmlq.PerChannel(axis))]
    with pytest.raises(odmlq.PlanError, match=r"table 'table' has int8 per-channel.*Use weight_granularity="
                                              r"PerTensor\(\) for this module"):
        odmlq.export_tflite(model, rules, batches, variables=variables)


def test_int16_softmax_is_within_its_kernel_tolerance():
    """LiteRT's int16 SOFTMAX interpolates lookup tables for exp and 1/x: it
    differs from the exact softmax by more than one rounding step, and
    verification allows it the spec's tolerance (128 int16 LSB, 1/256) on that
    edge only; every other edge keeps 1 LSB."""
    from odmlq.litert.spec import OP_SPEC

    batches = _batches((8,), 3.0)
    model = _Fn(jax.nn.softmax)
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    result = odmlq.export_tflite(model, rules, batches, variables=variables)
    assert "SOFTMAX" in result.summary.op_histogram
    checks = {c.edge: c for c in result.verification.checks}
    tolerance = OP_SPEC["softmax"].tolerance_lsb["int16"]
    assert checks["fc/softmax"].allowed_lsb == pytest.approx(tolerance + 1e-2)
    assert checks["fc/softmax"].max_lsb <= tolerance
    assert all(c.allowed_lsb == pytest.approx(1.01) for e, c in checks.items() if e != "fc/softmax")
    assert result.verification.passed


class _Int16Pieces(nn.Module):
    """An embedding, then x * x: GATHER_ND (+ QUANTIZE to int16) and MUL."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Dense(16, name="fc")(nn.Embed(30, 8, name="embed")(ids))
        return nn.Dense(4, name="out")(jnp.square(h) - h)


def test_int16_gather_and_square_verify_and_rsqrt_within_its_tolerance():
    """Their int16 kernels compute what `simulate` says, op by op within 1 LSB
    (the op table lists them for both schemas); int16 RSQRT approximates, and
    is verified within the op table's 64 LSB (a quarter of an int8 step)."""
    model = _Int16Pieces()
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 30, size=(8, 5)).astype(np.int32) for _ in range(3)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    result = odmlq.export_tflite(model, rules, batches, variables=variables)
    ops = result.summary.op_histogram
    assert {"GATHER_ND", "MUL"} <= set(ops), ops
    assert result.summary.float_islands == ()
    assert result.verification.passed, str(result.verification)
    assert all(c.allowed_lsb == pytest.approx(1.01) for c in result.verification.checks)
    assert {t.dtype for t in result.summary.tensors if not t.is_constant and "square" in t.name} == {"int16"}
    norm = _Fn(lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True)), features=8)
    x = _batches((8,))
    result = odmlq.export_tflite(norm, rules, x, variables=norm.init(jax.random.key(0), x[0][:1]))
    assert result.summary.float_islands == () and result.verification.passed, str(result.verification)
    rsqrt = next(c for c in result.verification.checks if c.edge == "fc/rsqrt")
    assert 64.0 <= rsqrt.allowed_lsb < 65.0 and rsqrt.max_lsb <= rsqrt.allowed_lsb


@pytest.mark.parametrize("after_relu", [True, False], ids=["after_relu", "signed_input"])
def test_int16_padded_max_pool(after_relu):
    """litert-converter pads an int16 max pool with PADV2 (no int16 kernel).
    After a ReLU (as in every ResNet stem) zeros pad it exactly, so odmlq
    lowers it as PAD + a VALID MAX_POOL_2D and it verifies within 1 LSB; a
    pool of signed values is refused before any work, naming the op."""
    def fn(x):
        x = nn.relu(x) if after_relu else x
        return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))

    model = _Fn(fn, features=4)
    batches = _batches((6, 6, 3))
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    if not after_relu:
        with pytest.raises(FloatOpsError, match=r"op 'fc/max_pool' .* PADV2 .* may be negative"):
            odmlq.export_tflite(model, rules, batches, variables=variables)
        return
    result = odmlq.export_tflite(model, rules, batches, variables=variables)
    ops = result.summary.op_histogram
    assert {"PAD", "MAX_POOL_2D"} <= set(ops) and "PADV2" not in ops, ops
    assert result.summary.float_islands == ()
    assert result.verification.passed, str(result.verification)
    assert all(c.max_lsb <= c.allowed_lsb == pytest.approx(1.01) for c in result.verification.checks)
    reference = np.asarray(model.apply(variables, batches[0]))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, batches[0], variables=variables))
    assert 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2)) >= 45.0  # int8 weights bound it
