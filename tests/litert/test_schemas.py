"""Every LiteRT schema through the real converter and interpreter, on trained digits models."""

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from odmlq.errors import PlanError
from samples.digits import accuracy, batches, load_digits_splits, train

R = odmlq.Rule


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


@pytest.fixture(scope="module")
def models(digits):
    return {name: train(name, digits, seconds=20, max_steps=300) for name in ("mlp", "cnn")}


def _export(models, digits, name, rules, **kwargs):
    model, variables = models[name]
    return odmlq.export_tflite(model, rules, batches(digits.x_calibration, 32), variables=variables, **kwargs)


def _weights(result):
    return [t for t in result.summary.tensors if t.is_constant and len(t.shape) >= 2]


SCHEMAS = {
    # name: (rules, weight dtype in the file, ops that must be there, ops that must not)
    "int8": ([R(".*", weight_qtype="int8", act_qtype="int8")], "int8", {"QUANTIZE", "FULLY_CONNECTED"}, {"DEQUANTIZE_WEIGHTS"}),
    "dynamic": ([R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)], "int8", {"FULLY_CONNECTED"}, {"DEQUANTIZE", "QUANTIZE", "STABLEHLO_COMPOSITE"}),
    "weight_only_int8": ([R(".*", weight_qtype="int8")], "int8", {"DEQUANTIZE", "FULLY_CONNECTED"}, {"TRANSPOSE", "QUANTIZE"}),
    "weight_only_int4": ([R(".*", weight_qtype="int4")], "int4", {"DEQUANTIZE", "FULLY_CONNECTED"}, {"TRANSPOSE", "QUANTIZE"}),
}


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_schema(models, digits, name, schema):
    rules, weight_dtype, present, absent = SCHEMAS[schema]
    result = _export(models, digits, name, rules)
    ops = set(result.summary.op_histogram)
    assert present <= ops, ops
    assert not (absent & ops), ops
    weights = _weights(result)
    if schema == "dynamic" and name == "cnn":
        # A dynamic-range depthwise convolution (conv1 reads one channel) keeps
        # its weight float: LiteRT's hybrid kernel for it runs outside XNNPACK.
        depthwise = [op for op in result.summary.ops if op.name == "DEPTHWISE_CONV_2D"]
        assert len(depthwise) == 1 and result.summary.tensors[depthwise[0].inputs[1]].dtype == "float32"
        assert result.delegation.partitions == 1 and result.delegation.outside == ()
        weights = [t for t in weights if t.index != depthwise[0].inputs[1]]
    assert weights and {t.dtype for t in weights} == {weight_dtype}
    assert all(len(t.scales) == (t.shape[0] if t.quantized_dimension == 0 else t.shape[-1]) for t in weights)
    assert result.verification.passed
    if weight_dtype == "int4":  # packed two per byte
        assert all(t.nbytes == (np.prod(t.shape) + 1) // 2 for t in weights)
    model, variables = models[name]
    from samples.digits_cnn import tflite_accuracy

    float_acc = accuracy(model, variables, digits.x_test, digits.y_test)
    assert tflite_accuracy(result.tflite, digits.x_test, digits.y_test) >= float_acc - 0.01


def test_dynamic_range_kernels_are_not_float(models, digits):
    """Dynamic-range: weights stay int8 into the kernel (no DEQUANTIZE), inputs quantized inside."""
    result = _export(models, digits, "mlp", SCHEMAS["dynamic"][0])
    fcs = [op for op in result.summary.ops if op.name == "FULLY_CONNECTED"]
    tensors = result.summary.tensors
    assert all(tensors[op.inputs[0]].dtype == "float32" and tensors[op.inputs[1]].dtype == "int8" for op in fcs)
    # Simulate quantizes the same inputs at run time; the kernels agree to within rounding.
    assert result.verification.output_sqnr_db >= 30


def test_a_dynamic_range_matmul_computes_what_simulate_does_row_by_row():
    """2048 rows of 256 inputs with varied ranges and offsets through one
    dynamic-range FULLY_CONNECTED on XNNPACK, one row per invoke: every row's
    64 outputs equal simulate's to float32 rounding (1e-5 of the row's
    largest). Simulate quantizes each row as XNNPACK's qd8 kernels do; with
    the input divided by the step instead, one of these rows gets a
    neighbouring code and is off by 2.7e-4."""
    model = nn.Dense(64)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2048, 256)) * rng.uniform(0.01, 10, (2048, 1))
         + rng.uniform(-3, 3, (2048, 1))).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    result = odmlq.export_tflite(model, [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)], [x[:64]],
                                 variables=variables, benchmark=False, progress=False)
    runner = odmlq.litert.interpreter(result.tflite, num_threads=1).get_signature_runner()
    (name,) = runner.get_input_details()
    litert = np.concatenate([next(iter(runner(**{name: row[None]}).values())) for row in x])
    simulated = np.asarray(odmlq.Simulator(model, result.plan, result.scales, variables=variables)(x))
    off = np.abs(simulated - litert).max(axis=1) / np.abs(litert).max(axis=1)
    assert np.count_nonzero(off > 1e-5) == 0, (np.count_nonzero(off > 1e-5), off.max())


def test_int16x8_dense(models, digits):
    result = _export(models, digits, "mlp", [R(".*", weight_qtype="int8", act_qtype="int16")])
    tensors = result.summary.tensors
    fcs = [op for op in result.summary.ops if op.name == "FULLY_CONNECTED"]
    assert len(fcs) == 3 and result.summary.float_islands == ()
    for op in fcs:
        assert tensors[op.outputs[0]].dtype == "int16" and tensors[op.outputs[0]].zero_points == (0,)
        assert tensors[op.inputs[1]].dtype == "int8"
        assert tensors[op.inputs[2]].dtype in ("int32", "int64")  # FULLY_CONNECTED 16x8 takes either
    assert result.verification.passed
    assert all(c.max_lsb <= 1.0 + 1e-3 for c in result.verification.checks)


def test_int16x8_convolutions_export_and_verify(models, digits):
    """litert-converter 0.5.0 writes an int32 bias the 16x8 kernels read as int64
    (outputs off by the whole range); the export rewrites it (`_repair`)."""
    result = _export(models, digits, "cnn", [R(".*", weight_qtype="int8", act_qtype="int16")])
    tensors = result.summary.tensors
    convs = [op for op in result.summary.ops if op.name in ("CONV_2D", "DEPTHWISE_CONV_2D")]
    assert convs and result.summary.float_islands == ()
    for op in convs:
        assert tensors[op.inputs[0]].dtype == "int16" and tensors[op.inputs[2]].dtype in ("int32", "int64")
    assert result.verification.passed
    assert all(c.max_lsb <= 1.0 + 1e-2 for c in result.verification.checks)  # float32 noise at int16


def test_int8_edge_into_int16_ops_is_requantized(models, digits):
    """LiteRT computes an int8-in, int16-out FULLY_CONNECTED wrongly (off by the
    whole range, without an error), so an int16 op reading an int8 edge reads
    it through a conversion: a QUANTIZE int8 -> int16 that simulate models."""
    rules = [R("conv.*", weight_qtype="int8", act_qtype="int8"), R(".*", weight_qtype="int8", act_qtype="int16")]
    model, variables = models["cnn"]
    plan = odmlq.plan(model, rules, digits.x_test[:1], variables=variables)
    conversions = {c.edge: c for c in plan.conversions.values()}
    assert set(conversions) == {"conv2/reshape"}, conversions  # dense1 reads the flattened int8 edge as int16
    assert conversions["conv2/reshape"].source == "int8" and conversions["conv2/reshape"].spec.qtype == "int16"
    result = _export(models, digits, "cnn", rules)
    requantize = [t for t in result.summary.tensors if t.dtype == "int16" and "conv2/reshape/to_int16" in t.name]
    assert requantize, "no int16 tensor made from conv2/reshape"
    # Every edge within 1 LSB of simulate (verification), int16 output within 1 LSB.
    assert result.verification.passed and result.verification.output_max_lsb <= 1


def test_int8_model_io(models, digits):
    result = _export(models, digits, "cnn", SCHEMAS["int8"][0], io_dtype="int8")
    summary = result.summary
    assert "QUANTIZE" not in summary.op_histogram and "DEQUANTIZE" not in summary.op_histogram
    assert summary.tensors[summary.inputs[0]].dtype == "int8"
    assert summary.tensors[summary.outputs[0]].dtype == "int8"
    assert result.verification.passed and result.verification.output_max_lsb == 0


def test_int8_io_needs_full_integer(models, digits):
    with pytest.raises(PlanError, match=r"io_dtype='int8' needs a full-integer model; this plan is weight_only"):
        _export(models, digits, "mlp", SCHEMAS["weight_only_int8"][0], io_dtype="int8")


def test_an_io_dtype_the_model_does_not_carry_is_refused_before_anything_is_written(models, digits, tmp_path):
    """Seen: io_dtype='int16' on an int8 model printed converter errors, then
    wrote an int8-I/O model over the user's file."""
    target = tmp_path / "model.tflite"
    target.write_bytes(b"the user's model")
    with pytest.raises(PlanError, match=r"io_dtype='int16', but the model's input 'input_0' is int8 in the plan; "
                                        r".*Use io_dtype='int8', or give that edge act_qtype='int16'"):
        model, variables = models["cnn"]
        odmlq.export_tflite(model, SCHEMAS["int8"][0], batches(digits.x_calibration, 32), str(target),
                            variables=variables, io_dtype="int16")
    assert target.read_bytes() == b"the user's model"


def test_mixing_static_and_dynamic_is_refused(models, digits):
    rules = [R("dense1", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
             R(".*", weight_qtype="int8", act_qtype="int8")]
    with pytest.raises(PlanError, match=r"quantizes edge 'reshape' at run time \(op 'reshape', rules\[0\] "
                                        r"has act_dynamic=True\) among statically quantized edges"):
        _export(models, digits, "mlp", rules)


@pytest.mark.parametrize("rules, match", [
    ([R(".*", weight_qtype="fp8_e4m3")], r"weight 'dense1/kernel' is fp8_e4m3; LiteRT stores weights as int8 or int4"),
    ([R(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(16))], r"LiteRT takes block scales only for the int4 weight of a dynamic-range matmul"),
    ([R(".*", weight_qtype="int8", act_qtype="int8", act_granularity=odmlq.PerChannel(-1))], r"per-channel; LiteRT activations are per-tensor"),
], ids=["fp8-weights", "block-weights", "per-channel-activations"])
def test_decisions_litert_cannot_honour_are_refused_first(models, digits, rules, match):
    with pytest.raises(PlanError, match=match):
        _export(models, digits, "mlp", rules)


def test_the_export_takes_a_batch_size_and_says_which(models, digits):
    result = _export(models, digits, "mlp", SCHEMAS["int8"][0], batch_size=4)
    assert result.batch_size == 4 and "batch size 4" in str(result)
    assert result.summary.tensors[result.summary.inputs[0]].shape[0] == 4
    assert _export(models, digits, "mlp", SCHEMAS["int8"][0]).batch_size == 1
    with pytest.raises(PlanError, match=r"batch_size=0: give an integer from 1 to the first batch's 32 rows"):
        _export(models, digits, "mlp", SCHEMAS["int8"][0], batch_size=0)


class _Tokens(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.gelu(nn.Dense(16, name="up")(x)))


def test_dynamic_matmul_inputs_are_quantized_per_row_as_the_hybrid_kernel_does():
    # (batch, tokens, features): LiteRT's hybrid FULLY_CONNECTED quantizes each token's row
    # with its own range, so the plan does too where LiteRT is a target, and every
    # backend computes it; XLA alone keeps the rule's one range per tensor.
    model = _Tokens()
    x = np.random.default_rng(0).normal(size=(4, 6, 12)).astype(np.float32)
    x[:, 0] *= 20  # one token's range far wider than the others'
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    litert_plan = odmlq.plan(model, rules, x[:1], variables=variables, target="litert")
    xla_plan = odmlq.plan(model, rules, x[:1], variables=variables, target="xla")
    assert litert_plan.ops["up/dot_general"].dynamic_input.scale_axes == (0, 1)
    assert litert_plan.edges["up/gelu"].spec.scale_axes == (0, 1)
    assert xla_plan.edges["up/gelu"].spec.scale_axes == ()
    result = odmlq.export_tflite(model, rules, [x[:2], x[2:]], variables=variables, progress=False)
    # Per tensor, the wide token's range costs the others most of their resolution and
    # LiteRT agreed with simulate at ~35 dB; per row they agree to float32 rounding.
    assert result.verification.output_sqnr_db >= 60.0, result.verification
    # XLA computes the same per-row ranges (the export's weights: its calibration rounds them).
    xla = odmlq.ptq(model, result.plan, variables, result.calibration)
    simulated = odmlq.simulate(model, result.plan, result.scales, x, variables=variables)
    np.testing.assert_allclose(np.asarray(xla(x)), np.asarray(simulated), rtol=1e-5, atol=1e-5)


class _HeadsOut(nn.Module):
    """Flax attention's output projection: a DenseGeneral contracting (heads, head dim)."""

    @nn.compact
    def __call__(self, x):
        heads = nn.DenseGeneral((4, 8), name="split")(x)  # (batch, tokens, 4, 8)
        return nn.DenseGeneral(16, axis=(-2, -1), name="merge")(nn.relu(heads))


def test_a_dynamic_input_contracted_over_two_trailing_axes_is_quantized_per_row_and_verifies():
    """FULLY_CONNECTED flattens (batch, tokens, heads, head dim) into rows of
    heads x head dim and quantizes each row: one range per (batch, token). The
    plan says so, and the export (refused before: 'per-channel') verifies."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 6, 16)) * rng.uniform(0.1, 4, size=(16, 6, 1))).astype(np.float32)
    model = _HeadsOut()
    variables = model.init(jax.random.key(0), x[:1])
    rules = [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    result = odmlq.export_tflite(model, rules, [x[:8]], variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    merged = [e for e in result.plan.edges.values() if e.spec is not None and e.spec.dynamic
              and len(result.plan.graph.edges[e.edge].shape) == 4]
    assert merged and all(tuple(e.spec.scale_axes) == (0, 1) for e in merged), merged
