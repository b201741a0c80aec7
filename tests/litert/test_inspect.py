"""Tests of odmlq.litert.inspect on flatbuffers written by the real litert-converter.

Models are small JAX functions annotated with `quant.fake_quant` composites,
converted without TensorFlow, and cross-checked against the LiteRT
interpreter's own reading of the same bytes.
"""

import flatbuffers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter
from litert_converter import converter_api_ext as ext
from litert_converter.mlir import ir
from litert_converter.mlir.passmanager import PassManager

from odmlq.errors import OdmlqError
from odmlq.litert import format_summary, inspect
from odmlq.litert.export import FloatOpsError, _check_summary
from odmlq.litert.inspect import ModelFileError, module_path_from_tensor_name

_RANGES = {"i4": (-8, 7), "i8": (-128, 127), "i16": (-32768, 32767)}
_rng = np.random.default_rng(0)
W = _rng.normal(size=(8, 16)).astype(np.float32)  # (out, in): FULLY_CONNECTED's own layout
B = _rng.normal(size=(8,)).astype(np.float32)
K = _rng.normal(size=(4, 3, 3, 2)).astype(np.float32)  # OHWI: CONV_2D's own layout
X = np.linspace(-1, 1, 16, dtype=np.float32)[None]
T = _rng.normal(size=(30, 8)).astype(np.float32)  # an embedding table


def _fake_quant_impl(x, *, dtype, scale, zero_point=None, quantization_dimension=None,
                     narrow_range=False):
    qmin, qmax = _RANGES[dtype]
    qmin += int(narrow_range)
    if np.size(scale) == 0:  # dynamic range: the scale is computed at run time
        s = jnp.max(jnp.abs(x)) / qmax
        return jnp.clip(jnp.round(x / s), qmin, qmax) * s
    zero_point = np.zeros(np.shape(scale), np.int64) if zero_point is None else zero_point
    if quantization_dimension is not None:
        shape = [1] * x.ndim
        shape[quantization_dimension] = -1
        s = jnp.asarray(np.asarray(scale).reshape(shape))
        zp = jnp.asarray(np.asarray(zero_point, np.float32).reshape(shape))
    else:  # Python scalars: an array constant would become an operand and block lowering
        s, zp = float(np.asarray(scale).reshape(())), float(np.asarray(zero_point).reshape(()))
    return (jnp.clip(jnp.round(x / s) + zp, qmin, qmax) - zp) * s


def _fake_quant(x, **attributes):
    # narrow_range must be an np.bool_: jax drops a plain False, and the
    # converter then leaves the composite unlowered.
    attributes.setdefault("narrow_range", np.bool_(False))
    return jax.lax.composite(lambda x, **kw: _fake_quant_impl(x, **kw),
                             name="quant.fake_quant")(x, **attributes)


def _activation(x, scale):
    return _fake_quant(x, dtype="i8", scale=np.array([scale], np.float32),
                       zero_point=np.array([0], np.int64))


def _weight(w, dtype, axis):
    qmax = _RANGES[dtype][1]
    scale = (np.abs(w).max(axis=tuple(a for a in range(w.ndim) if a != axis)) / qmax)
    return _fake_quant(jnp.asarray(w), dtype=dtype, scale=scale.astype(np.float32),
                       zero_point=np.zeros(scale.shape, np.int64),
                       narrow_range=np.bool_(dtype == "i8"), quantization_dimension=axis)


def _to_tflite(fn, example) -> bytes:
    # debug_info keeps the named-scope locations that become tensor names.
    text = jax.jit(fn).lower(example).as_text(debug_info=True)
    ctx = ir.Context()
    ext.prepare_mlir_context(ctx)
    with ctx:
        module = ir.Module.parse(text)
        config = ext.ConvertToTFLConfig()
        config.strict_qdq_mode = True
        ext.run_convert_to_tfl_passes(module, PassManager(), config)
        ext.set_signature(module.operation, "serving_default", ["x"], ["y"])
        return ext.export_flatbuffer_to_bytes(module.operation)


def _int8_dense(x):
    x = _activation(x, 0.05)
    with jax.named_scope("dense1/dot_general"):
        y = jax.nn.relu(x @ _weight(W, "i8", 0).T + B)
    return _activation(y, 0.1)


def _weight_only(dtype, transposed=False):
    def fn(x):
        with jax.named_scope("dense1/dot_general"):
            if transposed:  # (in, out), quantized along out: needs a run-time TRANSPOSE
                return x @ _weight(W.T, dtype, 1) + B
            return x @ _weight(W, dtype, 0).T + B
    return fn


def _int4_conv(x):
    with jax.named_scope("conv1/conv"):
        return jax.lax.conv_general_dilated(x, _weight(K, "i4", 0), (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "OHWI", "NHWC"))


def _dynamic(x):
    with jax.named_scope("dense1/dot_general"):
        x = _fake_quant(x, dtype="i8", scale=np.zeros((0,), np.float32))
        return x @ W.T


def _requantized_table(ids):
    """An int8 table gathered into an edge of another scale: litert-converter
    requantizes the whole table (a QUANTIZE of the constant) at every invoke."""
    table = _fake_quant(jnp.asarray(T), dtype="i8", scale=np.array([np.abs(T).max() / 127], np.float32),
                        zero_point=np.array([0], np.int64), narrow_range=np.bool_(True))
    with jax.named_scope("embed/gather"):
        rows = jnp.take(table, ids, axis=0, mode="clip")
    return _activation(rows, 0.05)


_MODELS = {
    "int8_dense": (_int8_dense, X),
    "int8_weight_only": (_weight_only("i8"), X),
    "int8_weight_only_in_out": (_weight_only("i8", transposed=True), X),
    "int4_weight_only": (_weight_only("i4"), X),
    "int4_weight_only_conv": (_int4_conv, np.zeros((1, 8, 8, 2), np.float32)),
    "dynamic_composite": (_dynamic, X),
    "int8_table_requantized": (_requantized_table, np.arange(5, dtype=np.int32)[None]),
}
# What litert-converter 0.5.0 really emits for each model.
_OPS = {
    "int8_dense": ["QUANTIZE", "FULLY_CONNECTED", "DEQUANTIZE"],
    "int8_weight_only": ["DEQUANTIZE", "FULLY_CONNECTED"],
    "int8_weight_only_in_out": ["DEQUANTIZE", "TRANSPOSE", "FULLY_CONNECTED"],
    "int4_weight_only": ["DEQUANTIZE", "FULLY_CONNECTED"],
    "int4_weight_only_conv": ["DEQUANTIZE", "CONV_2D"],
    "dynamic_composite": ["STABLEHLO_COMPOSITE", "FULLY_CONNECTED"],
    "int8_table_requantized": ["QUANTIZE", "RESHAPE", "GATHER_ND", "DEQUANTIZE"],
}


@pytest.fixture(scope="module")
def models() -> dict[str, bytes]:
    return {name: _to_tflite(fn, example) for name, (fn, example) in _MODELS.items()}


def _with_offset_buffers(model: bytes) -> bytes:
    """Rewrites a model with its tensors' buffers after the flatbuffer, as large models store them."""
    m = schema.ModelT.InitFromPackedBuf(model, 0)
    moved = sorted({t.buffer for t in m.subgraphs[0].tensors
                    if m.buffers[t.buffer].data is not None and len(m.buffers[t.buffer].data)})
    data = {i: np.asarray(m.buffers[i].data, np.uint8).tobytes() for i in moved}

    def pack() -> bytes:
        builder = flatbuffers.Builder(1024)
        builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    for i in moved:  # a placeholder offset first, to learn the flatbuffer's size
        m.buffers[i].data, m.buffers[i].offset, m.buffers[i].size = None, 1, len(data[i])
    size, tail = len(pack()), bytearray()
    for i in moved:
        tail.extend(bytes(-(size + len(tail)) % 16))
        m.buffers[i].offset = size + len(tail)
        tail.extend(data[i])
    head = pack()
    assert len(head) == size  # offsets are fixed-width uint64 fields
    return head + bytes(tail)


def _run(model: bytes, x: np.ndarray) -> np.ndarray:
    interpreter = Interpreter(model_content=model)
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def _names(ops) -> list[str]:
    return [op.name for op in ops]


@pytest.mark.parametrize("name", list(_MODELS))
def test_op_list_is_what_the_converter_emits(models, name):
    assert _names(inspect(models[name]).ops) == _OPS[name]


@pytest.mark.parametrize("name", [*_MODELS, "int8_dense_offset_buffers"])
def test_matches_the_interpreters_reading(models, name):
    model = (_with_offset_buffers(models["int8_dense"]) if name == "int8_dense_offset_buffers"
             else models[name])
    summary = inspect(model)
    interpreter = Interpreter(model_content=model)
    details = interpreter.get_tensor_details()
    assert len(details) == len(summary.tensors)
    for theirs, ours in zip(details, summary.tensors, strict=True):
        quantization = theirs["quantization_parameters"]
        assert (theirs["index"], theirs["name"]) == (ours.index, ours.name)
        # numpy has no int4: the interpreter reports INT4 tensors as int8.
        assert np.dtype(theirs["dtype"]).name == {"int4": "int8"}.get(ours.dtype, ours.dtype)
        assert tuple(theirs["shape"]) == ours.shape
        np.testing.assert_array_equal(quantization["scales"], np.float32(ours.scales))
        np.testing.assert_array_equal(quantization["zero_points"], np.int64(ours.zero_points))
        # The interpreter says 0 for an unquantized tensor; we say None.
        assert quantization["quantized_dimension"] == (ours.quantized_dimension or 0)
        assert (ours.quantized_dimension is None) == (len(ours.scales) == 0)
    for theirs, ours in zip(interpreter._get_ops_details(), summary.ops, strict=True):
        assert (theirs["index"], theirs["op_name"]) == (ours.index, ours.name)
        assert (tuple(theirs["inputs"]), tuple(theirs["outputs"])) == (ours.inputs, ours.outputs)
    assert summary.signatures == interpreter._get_full_signature_list()


def test_int8_dense_is_full_integer(models):
    summary = inspect(models["int8_dense"])
    assert summary.float_islands == () and summary.weight_work_at_run_time == ()
    quantize, fully_connected, dequantize = summary.ops
    x, kernel, bias = (summary.tensors[i] for i in fully_connected.inputs)
    assert (x.dtype, kernel.dtype, bias.dtype) == ("int8", "int8", "int32")
    # An int8 (8, 16) kernel is 128 bytes; its int32 bias 32.
    assert (kernel.nbytes, bias.nbytes, summary.weight_bytes) == (128, 32, 160)
    assert kernel.is_constant and not x.is_constant and x.nbytes == 0
    np.testing.assert_array_equal(kernel.scales, np.float32(np.abs(W).max(1) / 127))
    assert (kernel.quantized_dimension, set(kernel.zero_points)) == (0, {0})
    assert (x.scales, x.zero_points) == (pytest.approx((0.05,), rel=1e-7), (0,))
    assert (quantize.module_path, fully_connected.module_path, dequantize.module_path) == (
        "", "dense1/dot_general", None)
    assert summary.inputs == quantize.inputs and summary.outputs == dequantize.outputs
    assert summary.op_histogram == {"DEQUANTIZE": 1, "FULLY_CONNECTED": 1, "QUANTIZE": 1}
    assert summary.file_bytes == len(models["int8_dense"])


@pytest.mark.parametrize("name, run_time, module_path", [
    ("int8_weight_only", ["DEQUANTIZE"], "dense1/dot_general"),
    ("int8_weight_only_in_out", ["DEQUANTIZE", "TRANSPOSE"], "dense1/dot_general"),
    ("int4_weight_only", ["DEQUANTIZE"], "dense1/dot_general"),
    ("int4_weight_only_conv", ["DEQUANTIZE"], "conv1/conv"),
])
def test_weight_only_models_compute_in_float_by_design(models, name, run_time, module_path):
    summary = inspect(models[name])
    # Every op computes in float, as weight-only means: no op is an island in
    # an integer graph, but the weight work is redone at every invocation.
    assert summary.schema == "weight_only" and summary.float_islands == ()
    assert _names(summary.ops) == _OPS[name]
    assert _names(summary.weight_work_at_run_time) == run_time
    # The float op's output was renamed as the graph output; its weights keep the scope.
    assert [op.module_path for op in summary.ops] == [module_path] * len(_OPS[name])
    assert "Float islands: none counted: a weight-only model computes in float by design" in str(summary)


@pytest.mark.parametrize("name, elements", [("int4_weight_only", 8 * 16),
                                            ("int4_weight_only_conv", 4 * 3 * 3 * 2)])
def test_int4_weights_are_stored_packed(models, name, elements):
    summary = inspect(models[name])
    (weight,) = [t for t in summary.tensors if t.dtype == "int4"]
    assert weight.is_constant and weight.nbytes == elements // 2


def test_a_weight_requantized_at_every_invoke_is_found_and_refused(models):
    summary = inspect(models["int8_table_requantized"])
    assert _names(summary.weight_work_at_run_time) == ["QUANTIZE"]
    table = summary.tensors[summary.weight_work_at_run_time[0].inputs[0]]
    assert table.is_constant and table.dtype == "int8"
    with pytest.raises(FloatOpsError, match="requantize weights at every invocation: QUANTIZE"):
        _check_summary("static", summary, allow_float_ops=True, float_ops=[])


def test_unlowered_composite_is_a_float_island(models):
    summary = inspect(models["dynamic_composite"])
    assert _names(summary.float_islands) == ["STABLEHLO_COMPOSITE", "FULLY_CONNECTED"]
    assert summary.float_islands[0].module_path == "dense1/dot_general"
    assert summary.ops[1].inputs[2] == -1  # no bias: the flatbuffer's omitted optional input


def test_offset_buffers_read_like_inline_ones(models):
    inline = models["int8_dense"]
    offset = _with_offset_buffers(inline)
    # The interpreter computes the same outputs, so the weights really live at the offsets.
    np.testing.assert_array_equal(_run(offset, X), _run(inline, X))
    a, b = inspect(inline), inspect(offset)
    assert (a.tensors, a.ops, a.weight_bytes) == (b.tensors, b.ops, b.weight_bytes)
    assert b.file_bytes == len(offset) > len(inline)
    with pytest.raises(ModelFileError, match=r"truncated: buffer \d+ lies at bytes"):
        inspect(offset[:-1])


def test_format_summary_shows_ops_modules_and_islands(models):
    summary = inspect(models["int8_weight_only_in_out"])
    text = format_summary(summary)
    assert str(summary) == text
    for expected in ["LiteRT model (weight-only)", "DEQUANTIZE", "TRANSPOSE", "FULLY_CONNECTED",
                     "dense1/dot_general", "Float islands: none counted",
                     "Weights requantized, dequantized or transposed at run time (2)",
                     "int8", "s=[8] axis=1 zp=0", f"file: {len(models['int8_weight_only_in_out'])} bytes"]:
        assert expected in text, text
    assert "float islands;" not in text, text
    clean = format_summary(inspect(models["int8_dense"]))
    assert "LiteRT model (integer activations)" in clean, clean
    assert "Float islands (0): none" in clean and "Weights: 160 bytes" in clean, clean
    assert "; 0 float islands;" in clean, clean
    island = format_summary(inspect(models["dynamic_composite"]))
    assert "Float islands (2)" in island and "; 2 float islands;" in island, island


def test_reads_paths(models, tmp_path):
    path = tmp_path / "model.tflite"
    path.write_bytes(models["int8_dense"])
    assert inspect(path).tensors == inspect(str(path)).tensors == inspect(models["int8_dense"]).tensors


@pytest.mark.parametrize("name, expected", [
    ("jit(f)/conv1/conv/composite", "conv1/conv"),
    ("jit(model2)/dense1/dot_general/dot_general;jit(model2)/dense1/dot_general/transpose;max",
     "dense1/dot_general"),
    ("max;jit(f)/block/relu/max", "block/relu"),  # a bare converter name carries no scope
    ("jit(f)/composite", ""),  # an op at the top level
    ("jit(<lambda>)/a/b/add", "a/b"),
    ("serving_default_x", None),
    ("serving_default_y_output", None),
    ("", None),
], ids=["scoped", "fused", "bare_first", "top_level", "lambda", "input", "output", "empty"])
def test_module_path_from_tensor_name(name, expected):
    assert module_path_from_tensor_name(name) == expected


_SCOPE = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@given(scopes=st.lists(_SCOPE, max_size=4), primitive=_SCOPE,
       fused=st.lists(st.sampled_from(["max", "jit(f)/other/add", "serving_default_y"]), max_size=3))
def test_module_path_is_the_scopes_of_the_first_jit_location(scopes, primitive, fused):
    name = ";".join([f"jit(model)/{'/'.join([*scopes, primitive])}", *fused])
    assert module_path_from_tensor_name(name) == "/".join(scopes)


def test_model_file_error_is_an_odmlq_value_error():
    assert issubclass(ModelFileError, OdmlqError) and issubclass(ModelFileError, ValueError)


@pytest.mark.parametrize("model, match", [
    (b"not a model at all", r"model bytes \(18 bytes\) is not a \.tflite flatbuffer: bytes 4\.\.8 "
                            r"are b'a mo', expected the file identifier b'TFL3'"),
    (b"abc", r"is not a \.tflite flatbuffer"),
    (b"\xff\xff\xff\xffTFL3" + bytes(8), r"has the \.tflite identifier but is truncated or corrupt"),
    (b"\x08\x00\x00\x00TFL3" + bytes(4), r"has no subgraph"),
], ids=["text", "too_short", "corrupt", "no_subgraph"])
def test_bad_bytes(model, match):
    with pytest.raises(ModelFileError, match=match):
        inspect(model)


def test_bad_files(models, tmp_path):
    with pytest.raises(ModelFileError, match=r"cannot read model file '.*missing\.tflite'.*"
                                             r"expected the path of an existing \.tflite file"):
        inspect(tmp_path / "missing.tflite")
    with pytest.raises(ModelFileError, match=r"cannot read model file"):
        inspect(tmp_path)
    path = tmp_path / "model.json"
    path.write_text("{}")
    with pytest.raises(ModelFileError, match=r"model file '.*model\.json' is not a \.tflite"):
        inspect(path)
    truncated = tmp_path / "truncated.tflite"
    truncated.write_bytes(models["int8_dense"][:200])
    with pytest.raises(ModelFileError, match=r"truncated\.tflite' has the \.tflite identifier but"):
        inspect(truncated)



def test_a_fused_op_is_labelled_with_its_own_module():
    """A convolution with a folded BatchNorm and a ReLU is named after all three
    locations; its label is the convolution's, not the first fused one's."""
    import flax.linen as nn

    import odmlq

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3), name="conv")(x)
            x = nn.BatchNorm(use_running_average=True, name="bn")(x)
            return nn.Dense(3, name="head")(nn.relu(x).reshape(x.shape[0], -1))

    x = np.random.default_rng(0).random((4, 8, 8, 2), np.float32)
    variables = Net().init(jax.random.PRNGKey(0), x)
    variables = {"params": variables["params"], "batch_stats": jax.tree.map(
        lambda v: v + 0.5, variables["batch_stats"])}
    for rules in ([odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], []):
        summary = odmlq.export_tflite(Net(), rules, [x], variables=variables, verify=False, progress=False).summary
        (conv,) = [op for op in summary.ops if op.name == "CONV_2D"]
        # Named 'conv/relu/max;conv/conv/...': the first location is the fused ReLU's.
        assert conv.module_path == "conv/conv", [(op.name, op.module_path) for op in summary.ops]
        assert ";" in summary.tensors[conv.outputs[0]].name  # several locations were fused into it
