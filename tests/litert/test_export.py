"""export_tflite end to end: the real converter, the real interpreter, real digits."""

import os

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

import odmlq
from odmlq.errors import CalibrationError
from odmlq.litert import FloatOpsError, inspect
from samples.digits import batches, load_digits_splits, train

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


@pytest.fixture(scope="module", params=["mlp", "cnn", "mlp_nnx", "cnn_nnx"])
def exported(request, digits):
    # 500 steps (about 1-3 s here) train every sample to 97-98% test accuracy;
    # the step cap, not the clock, ends training, so the weights are reproducible.
    model, variables = train(request.param, digits, seconds=20, max_steps=500)
    result = odmlq.export_tflite(model, INT8, batches(digits.x_calibration, 32), variables=variables)
    return request.param, model, variables, result


def test_full_integer_no_float_islands(exported):
    name, _, _, result = exported
    summary = result.summary
    assert summary.float_islands == ()
    assert summary.weight_work_at_run_time == ()
    ops = [op.name for op in summary.ops]
    assert ops[0] == "QUANTIZE" and ops[-1] == "DEQUANTIZE"
    assert ops.count("QUANTIZE") == 1 and ops.count("DEQUANTIZE") == 1
    assert "serving_default" in summary.signatures


def test_weights_in_the_flatbuffer_are_per_channel_int8_and_equal_ours(exported):
    """Weight and bias integers in the .tflite vs our own quantization (the
    weights as GPTQ, odmlq's default, rounded them): exact."""
    from ai_edge_litert.interpreter import Interpreter

    name, model, variables, result = exported
    params = odmlq.scales.flat_params(variables if variables is not None else model)
    weights = odmlq.scales.flat_params(odmlq.scales.folded_weights(
        result.plan.graph, variables if variables is not None else odmlq.graph.params_for(model, None, "test"),
        result.scales))
    assert set(result.scales.weight_values) == set(result.scales.weights)  # GPTQ rounded every kernel
    interpreter = Interpreter(model_content=result.tflite)
    interpreter.allocate_tensors()
    tensors = {t.name: t for t in result.summary.tensors}
    kernel_ops = [op for op in result.summary.ops if op.name in ("FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D")]
    # One kernel per quantized weight (an average pool may add a depthwise one of its own).
    assert len(kernel_ops) >= len(result.scales.weights)
    for path, ts in result.scales.weights.items():
        t = tensors[f"jit(fn)/{path}/composite"] if f"jit(fn)/{path}/composite" in tensors else next(
            t for t in result.summary.tensors if t.is_constant and t.dtype == "int8" and path in t.name)
        assert t.dtype == "int8" and t.is_constant
        ours = np.asarray(ts.quantize(np.asarray(weights[path])).values())
        axis = ts.scale_axes[0]
        native = np.moveaxis(ours, axis, 0)  # LiteRT stores output channels first
        stored = interpreter.get_tensor(t.index)
        if stored.shape != native.shape:  # DEPTHWISE_CONV_2D keeps channels last: (1, H, W, C)
            native = np.moveaxis(native, 0, -1).reshape(stored.shape)
        np.testing.assert_array_equal(stored, native)
        op = next(op for op in kernel_ops if t.index in op.inputs)
        bias = interpreter.get_tensor(op.inputs[2])
        bias_path = path.rsplit("/", 1)[0] + "/bias"
        expected = np.round(np.asarray(params[bias_path]) / result.scales.biases[bias_path])
        assert bias.dtype == np.int32
        np.testing.assert_array_equal(bias, expected.astype(np.int32))


def test_verified_within_one_lsb_and_end_to_end_within_two(exported):
    _, _, _, result = exported
    report = result.verification
    assert report.passed and report.samples >= 16
    assert not report.unmapped_edges  # every quantized edge was found and checked
    for check in report.checks:
        assert check.params_match, check.edge
        assert check.max_lsb <= 1.0 + 1e-3, (check.edge, check.max_lsb)  # 1 LSB: kernel rounding
    assert report.output_max_lsb <= 2.0 + 1e-3


def test_int8_file_is_under_30_percent_of_float(exported, digits):
    name, model, variables, result = exported
    float_result = odmlq.export_tflite(model, [], batches(digits.x_calibration[:32], 32),
                                       variables=variables, verify=False)
    # The float model computes in float by design: no op of it is an island.
    assert float_result.summary.schema == "float" and float_result.summary.float_islands == ()
    assert len(result.tflite) < 0.30 * len(float_result.tflite), (len(result.tflite), len(float_result.tflite))


def test_int8_accuracy_within_one_point_of_float(exported, digits):
    from samples.digits_cnn import tflite_accuracy

    from samples.digits import accuracy

    name, model, variables, result = exported
    x, y = digits.x_test, digits.y_test  # all 540 test images: one image is 0.19 points
    float_acc = accuracy(model, variables, x, y)
    int8_acc = tflite_accuracy(result.tflite, x, y)
    assert int8_acc >= float_acc - 0.01, (float_acc, int8_acc)


@pytest.fixture(scope="module")
def small_cnn(digits):
    model, variables = train("cnn", digits, seconds=1, max_steps=20)
    return model, variables


def test_written_atomically_and_replaces_existing_file(small_cnn, digits, tmp_path):
    model, variables = small_cnn
    path = tmp_path / "model.tflite"
    path.write_bytes(b"old contents")
    result = odmlq.export_tflite(model, INT8, batches(digits.x_calibration[:64], 32), path,
                                 variables=variables, verify=False)
    assert path.read_bytes() == result.tflite
    assert sorted(os.listdir(tmp_path)) == ["model.tflite"]  # no temp file left behind
    assert inspect(path).ops[0].name == "QUANTIZE"


def test_failed_export_leaves_existing_file_untouched(small_cnn, tmp_path):
    model, variables = small_cnn
    path = tmp_path / "model.tflite"
    path.write_bytes(b"old contents")
    bad = [np.full((4, 8, 8, 1), np.nan, np.float32), np.zeros((4, 8, 8, 1), np.float32)]
    with pytest.raises(CalibrationError):
        odmlq.export_tflite(model, INT8, bad, path, variables=variables)
    assert path.read_bytes() == b"old contents"
    assert sorted(os.listdir(tmp_path)) == ["model.tflite"]


def test_unwritable_directory(small_cnn, digits, tmp_path):
    """A directory nobody may create files in: sysfs refuses even root."""
    model, variables = small_cnn
    target = "/sys/odmlq-test.tflite"
    if os.access("/sys", os.W_OK) and not os.path.isdir("/sys/kernel"):
        pytest.skip("no read-only sysfs on this machine")
    with pytest.raises(odmlq.OdmlqError, match=r"Cannot write '/sys/odmlq-test.tflite': Permission denied; choose a writable directory"):
        odmlq.export_tflite(model, INT8, batches(digits.x_calibration[:64], 32), target,
                            variables=variables, verify=False)
    assert not os.path.exists(target)


def test_missing_directory_is_a_clear_error(small_cnn, digits, tmp_path):
    model, variables = small_cnn
    with pytest.raises(odmlq.OdmlqError, match=r"Cannot write .*: directory .* does not exist"):
        odmlq.export_tflite(model, INT8, batches(digits.x_calibration[:64], 32),
                            tmp_path / "no" / "m.tflite", variables=variables, verify=False)


def test_empty_rep_dataset(small_cnn, digits):
    model, variables = small_cnn
    with pytest.raises(CalibrationError, match="rep_dataset yielded no batches"):
        odmlq.export_tflite(model, INT8, [], variables=variables, example_inputs=(digits.x_test[:1],))


def test_nan_batch_names_batch_and_input(small_cnn):
    model, variables = small_cnn
    good = np.zeros((4, 8, 8, 1), np.float32)
    bad = good.copy()
    bad[1, 2, 3, 0] = np.inf
    with pytest.raises(CalibrationError, match=r"rep_dataset batch 1, input 0: 1 NaN or Inf"):
        odmlq.export_tflite(model, INT8, [good, bad, good], variables=variables)


def test_batch_of_wrong_shape(small_cnn):
    model, variables = small_cnn
    with pytest.raises(CalibrationError, match=r"batch 1, input 0: shape \(4, 8, 8, 3\) float32 does not match"):
        odmlq.export_tflite(model, INT8, [np.zeros((4, 8, 8, 1), np.float32),
                                          np.zeros((4, 8, 8, 3), np.float32),
                                          np.zeros((4, 8, 8, 1), np.float32)], variables=variables)


class _Constant(nn.Module):
    @nn.compact
    def __call__(self, x):
        dead = nn.relu(nn.Dense(8, name="fc")(x))  # all zero: its bias is set to -1000 below
        return nn.Dense(4, name="head")(dead)


def test_constant_activation_gets_a_valid_scale():
    model, x = _Constant(), np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v - 1000.0 if "fc" in str(p) and "bias" in str(p) else v, variables)
    result = odmlq.export_tflite(model, INT8, [x[:8], x[8:]], variables=variables)
    zero = [ts for e, ts in result.scales.edges.items() if e.endswith("relu")]
    assert zero and all(np.all(np.isfinite(ts.scale)) and np.all(ts.scale > 0) for ts in zero)
    assert result.verification.passed


class _Sine(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.sin(nn.Dense(4, name="fc")(x))


def test_op_without_integer_kernel_is_refused_before_work():
    model, x = _Sine(), np.ones((2, 4), np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    with pytest.raises(FloatOpsError, match=r"op 'fc/sin' .* LiteRT has no int8 kernel for 'sin'"):
        odmlq.export_tflite(model, INT8, [x], variables=variables)


class _TiedLM(nn.Module):
    """A token table looked up and read again as the output projection (GPT-2's)."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(64, 32, name="embed")
        return embed.attend(nn.Dense(32, name="mix")(embed(tokens)))


def test_an_int4_table_is_refused_before_conversion_with_a_rule_for_each_reader():
    """litert-converter 0.5.0 keeps an int4 table's gathered rows int4 and fails at their
    first reader, naming no op; the plan check names the table and the modules reading it."""
    model, tokens = _TiedLM(), np.arange(16, dtype=np.int32).reshape(2, 8) % 64
    variables = model.init(jax.random.key(0), tokens[:1])
    # Both readers, the lookup and the output projection (Flax's `embed.attend` scope),
    # are the module 'embed': one rule covers them.
    with pytest.raises(odmlq.PlanError, match=r"op 'embed/gather' \(module 'embed', rules\[0\]\): table "
                                              r"'embed/embedding' is int4; LiteRT has no int4 gather.*"
                                              r"Rule\('embed', weight_qtype='int8'\)"):
        odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int4")], [tokens], variables=variables,
                            progress=False)
    # As the error says: the table int8 for every op reading it, the rest int4.
    rules = [odmlq.Rule("embed", weight_qtype="int8"), odmlq.Rule(".*", weight_qtype="int4")]
    result = odmlq.export_tflite(model, rules, [tokens], variables=variables, progress=False, benchmark=False)
    assert result.verification.passed


class _TwoConvs(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Conv(8, (3, 3), name="conv2")(jnp.tanh(nn.Conv(8, (3, 3), name="conv1")(x)))


def test_a_convolution_after_float_ops_at_the_input_is_an_integer_kernel():
    """litert-converter 0.5.0 fuses a convolution into an integer kernel only
    when the float ops before it read a quantized model input (else it keeps
    the convolution float, its filter dequantized at every invoke, although
    its input and output are quantized). The plan carries such an input in
    int16 for LiteRT; the float ops read it dequantized."""
    model, x = _TwoConvs(), np.random.default_rng(0).normal(size=(4, 6, 6, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule("conv1", skip=True), odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, [x], variables=variables, allow_float_ops=True)
    carried = result.plan.edges["input_0"]
    assert carried.spec.qtype == "int16" and carried.reason.startswith("carried in int16 for conv2/conv")
    assert result.summary.weight_work_at_run_time == ()
    tensors = result.summary.tensors
    conv2 = next(o for o in result.summary.ops if o.module_path == "conv2/conv")
    assert conv2.name == "CONV_2D" and tensors[conv2.inputs[0]].dtype == "int8", conv2
    assert tensors[result.summary.ops[0].outputs[0]].dtype == "int16"  # the input's QUANTIZE
    assert result.verification.passed, str(result.verification)
    # A plan for XLA alone does not carry it: XLA's quantized ops read float edges.
    assert odmlq.plan(model, rules, x[:1], variables=variables, target="xla").edges["input_0"].spec is None
    with pytest.raises(odmlq.PlanError, match=r"input 'input_0' is int16 .* carries it in int16 for a convolution"):
        odmlq.export_tflite(model, rules, [x], variables=variables, allow_float_ops=True, io_dtype="int8")


class _ConvPool(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3), name="conv1")(x)), (2, 2), (2, 2))
        return nn.Dense(4, name="head")(x.reshape(x.shape[0], -1))


def test_an_int8_average_pool_after_a_float_convolution_is_carried_too():
    """An int8 average pool is a DEPTHWISE_CONV_2D in the file, which
    litert-converter fuses only as it does a convolution; before the carrier
    the whole graph after it stayed float."""
    model, x = _ConvPool(), np.random.default_rng(0).normal(size=(4, 6, 6, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", op="conv", skip=True), odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, [x], variables=variables, allow_float_ops=True)
    assert result.plan.edges["input_0"].spec.qtype == "int16"
    assert result.summary.weight_work_at_run_time == ()
    tensors = result.summary.tensors
    fused = [o for o in result.summary.ops if o.name in ("DEPTHWISE_CONV_2D", "FULLY_CONNECTED")
             and tensors[o.inputs[0]].dtype == "int8"]
    assert len(fused) == 2, [(o.name, tensors[o.inputs[0]].dtype) for o in result.summary.ops]
    assert result.verification.passed, str(result.verification)


class _Spectrum(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.abs(jnp.fft.fft(nn.Dense(8, name="fc")(x)))


def test_converter_failure_keeps_its_diagnostic_and_names_the_module():
    model, x = _Spectrum(), np.ones((2, 4), np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", op=("fft", "abs", "convert_element_type"), skip=True), *INT8]
    with pytest.raises(odmlq.litert.ConversionError,
                       match=r"(?s)fft.* was not converted to a LiteRT op.*Failing: op 'fc/fft' \(module 'fc', kind 'fft'\)"):
        odmlq.export_tflite(model, rules, [x], variables=variables, allow_float_ops=True)


def test_batch_of_wrong_dtype(small_cnn):
    model, variables = small_cnn
    good = np.zeros((4, 8, 8, 1), np.float32)
    with pytest.raises(CalibrationError, match=r"batch 1, input 0: shape \(4, 8, 8, 1\) int32 does not match the example input \(1, 8, 8, 1\) float32"):
        odmlq.export_tflite(model, INT8, [good, good.astype(np.int32), good], variables=variables)


def test_rep_dataset_as_a_callable_of_jax_arrays(small_cnn, digits):
    model, variables = small_cnn
    data = jnp.asarray(digits.x_calibration[:64])
    result = odmlq.export_tflite(model, INT8, lambda: (data[i:i + 32] for i in range(0, 64, 32)),
                                 variables=variables)
    assert result.verification.passed and result.calibration is not None


class _ErfGelu(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(jax.nn.gelu(nn.Dense(8, name="fc")(x), approximate=False))


def test_float_ops_warning_groups_them_by_module():
    """An erf GELU kept in float is dozens of LiteRT ops: the warning counts them per module."""
    model, x = _ErfGelu(), np.linspace(-3, 3, 32, dtype=np.float32).reshape(8, 4)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", op="gelu", skip=True), *INT8]
    with pytest.warns(UserWarning, match="float ops in the exported model") as caught:
        result = odmlq.export_tflite(model, rules, [x], variables=variables, allow_float_ops=True)
    message = next(str(w.message) for w in caught if "float ops in the exported" in str(w.message))
    gelu_ops = [o for o in result.summary.float_islands if o.name not in ("QUANTIZE", "DEQUANTIZE")]
    assert len(gelu_ops) > 10
    mul = sum(o.name == "MUL" for o in gelu_ops)
    assert f"MUL x{mul}" in message and message.count("(module ") <= 4, message


def test_a_float_gelu_between_quantized_ops_runs_whole_on_xnnpack():
    """A GELU kept in float between int8 ops is written x/2 (1 + erf(x/sqrt 2)):
    litert-converter lowers that erf to a clamped polynomial XNNPACK runs.
    jax.nn.gelu's own erfc form became LESS / SELECT ops XNNPACK does not run
    (8 here, and 4 partitions; on MiniLM 48 ops off the delegate). The two
    forms agree within 1.1e-6 for every float32 input (their float32
    roundings), far below any quantized reader's LSB; verified op by op."""
    from odmlq.litert._forms import gelu_erf

    x = np.linspace(-12, 12, 2_000_001, dtype=np.float32)
    assert np.max(np.abs(np.asarray(gelu_erf(x), np.float64) - jax.nn.gelu(x, approximate=False))) < 1.1e-6
    model = _ErfGelu()
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", op="gelu", skip=True), *INT8]
    with pytest.warns(UserWarning, match="float ops"):
        result = odmlq.export_tflite(model, rules, [x[i:i + 16] for i in range(0, 64, 16)], variables=variables,
                                     allow_float_ops=True, progress=False)
    names = [op.name for op in result.summary.ops]
    assert "LESS" not in names and "SELECT" not in names and "FULLY_CONNECTED" in names
    assert not result.delegation.outside and result.delegation.partitions == 1
    assert result.verification.passed


def test_a_plan_traced_at_another_batch_size_exports(small_cnn, digits):
    # The plan's graph has batch 32 (its reshape too); the file has batch 1.
    model, variables = small_cnn
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, digits.x_calibration[:32], variables=variables)
    result = odmlq.export_tflite(model, plan, batches(digits.x_calibration, 32), variables=variables,
                                 progress=False)
    assert result.batch_size == 1 and result.verification.output_max_lsb <= 1.0


class _Int16Offset(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="dense")(x) + 0.5


def test_an_int16_plan_traced_at_another_batch_size_exports():
    """An int16 ADD stores its constant broadcast to the output's shape: the
    exported graph's (batch 1), not the plan's (batch 16). Taken from the
    plan, it made the converter refuse this ADD (`tfl.add` failed to
    verify) and, on MiniLM, the annotation fail with a bare TypeError."""
    model = _Int16Offset()
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")], x[:16],
                      variables=variables)
    result = odmlq.export_tflite(model, plan, [x[i:i + 16] for i in range(0, 64, 16)], variables=variables,
                                 progress=False)
    assert result.batch_size == 1 and result.verification.passed


class _TwoMethods(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="dense")(x)

    def scaled(self, x, factor):
        return self(x) * factor


def test_a_method_exports_at_another_batch_size_with_its_own_input_names():
    model, rng = _TwoMethods(), np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    factor = np.full((8, 1), 3.0, np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    # Calibrated at batch 4, exported at batch 1: the method is traced again for it.
    result = odmlq.export_tflite(model, rules, [(x[:4], factor[:4]), (x[4:], factor[4:])], variables=variables,
                                 method="scaled", progress=False)
    assert result.batch_size == 1 and result.plan.graph.method == "scaled"
    runner = odmlq.litert.interpreter(result.tflite)
    assert [d["name"] for d in runner.get_input_details()] == ["serving_default_x", "serving_default_factor"]
    out = runner.get_signature_runner()(x=x[:1], factor=factor[:1])["output_0"]
    expected = np.asarray(model.apply(variables, x[:1], factor[:1], method="scaled"))
    np.testing.assert_allclose(out, expected, atol=4 * float(np.max(result.scales.edges[
        result.plan.graph.outputs[0]].scale)))  # int8 weights and edges: a few output LSBs from float
    # The plan remembers the method through JSON; another method for it is refused.
    assert odmlq.Plan.from_json(result.plan.to_json()).graph.method == "scaled"
    with pytest.raises(odmlq.PlanError, match="method='__call__', but the plan given traced 'scaled'"):
        odmlq.export_tflite(model, result.plan, [(x, factor)], variables=variables, method="__call__",
                            progress=False)
