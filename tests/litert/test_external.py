"""Weights after the flatbuffer (`external_weights`): the converter sees
placeholders, the file holds the same integers at Buffer.offset, and LiteRT
computes exactly what the inline file computes."""

import re

import jax
import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as schema

import odmlq
from odmlq.errors import OdmlqError
from odmlq.litert import _convert, _external
from odmlq.litert._prepare import prepare
from odmlq.litert.export import annotated
from samples.models import cnn, mlp
from tests._runs import litert_rows
from tests.litert import _decoder

R = odmlq.Rule
SCHEMAS = {
    "int8": [R(".*", weight_qtype="int8", act_qtype="int8")],
    "dynamic": [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
    "weight-only": [R(".*", weight_qtype="int8")],
    "int4 weight-only": [R(".*", weight_qtype="int4")],
    "int16x8": [R(".*", weight_qtype="int8", act_qtype="int16")],
}


def _digits(n=3):
    return [np.random.default_rng(i).normal(size=(8, 8, 8, 1)).astype(np.float32) for i in range(n)]


def _constants(tflite: bytes) -> dict[tuple[int, str], bytes]:
    """(subgraph, tensor name) -> the bytes of each constant integer tensor, read
    from the flatbuffer or from after it."""
    model = schema.Model.GetRootAsModel(tflite, 0)
    out = {}
    for g in range(model.SubgraphsLength()):
        graph = model.Subgraphs(g)
        for i in range(graph.TensorsLength()):
            tensor = graph.Tensors(i)
            if tensor.Type() not in (schema.TensorType.INT8, schema.TensorType.INT4, schema.TensorType.INT16,
                                     schema.TensorType.INT32, schema.TensorType.INT64):
                continue
            buffer = model.Buffers(tensor.Buffer())
            if buffer.DataLength():
                out[g, tensor.Name().decode()] = buffer.DataAsNumpy().tobytes()
            elif buffer.Offset() > 1:
                out[g, tensor.Name().decode()] = tflite[buffer.Offset():buffer.Offset() + buffer.Size()]
    return out


def _external_buffers(tflite: bytes) -> list[tuple[int, int]]:
    model = schema.Model.GetRootAsModel(tflite, 0)
    return [(model.Buffers(b).Offset(), model.Buffers(b).Size()) for b in range(model.BuffersLength())
            if model.Buffers(b).Offset() > 1]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_external_weights_hold_the_inline_files_integers_and_compute_the_same(name):
    model, _, variables = cnn()
    data = _digits()
    inline = odmlq.export_tflite(model, SCHEMAS[name], data, variables=variables, external_weights=False,
                                 progress=False)
    external = odmlq.export_tflite(model, SCHEMAS[name], data, variables=variables, external_weights=True,
                                   progress=False)
    assert external.verification.passed
    # Every quantized kernel lies after the flatbuffer, 64-byte aligned, inside the file.
    buffers = _external_buffers(external.tflite)
    kernels = [t for t in inline.summary.tensors if t.is_constant and t.dtype in ("int8", "int4")
               and len(t.shape) >= 2 and "kernel/composite" in t.name]
    assert len(buffers) == len(kernels) >= 3
    assert all(offset % 64 == 0 and offset + size <= len(external.tflite) for offset, size in buffers)
    assert external.summary.weight_bytes == inline.summary.weight_bytes
    # The same integer tensors, byte for byte (0 LSB), and the same outputs.
    assert _constants(external.tflite) == _constants(inline.tflite)
    assert external.summary.op_histogram == inline.summary.op_histogram
    rows = np.concatenate(data)[:8]
    np.testing.assert_array_equal(litert_rows(external.tflite, rows), litert_rows(inline.tflite, rows))


def test_int4_blocks_go_after_the_flatbuffer_with_their_integers():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, name="fc2")(nn.relu(nn.Dense(128, name="fc1")(x)))

    model = MLP()
    variables = model.init(jax.random.key(0), np.zeros((1, 256), np.float32))
    data = [np.random.default_rng(i).standard_normal((16, 256)).astype(np.float32) for i in range(4)]
    rules = [R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True, weight_granularity=odmlq.PerBlock(128))]
    inline = odmlq.export_tflite(model, rules, data, variables=variables, external_weights=False, progress=False)
    external = odmlq.export_tflite(model, rules, data, variables=variables, external_weights=True, progress=False,
                                   require_delegate=True)
    assert external.verification.passed and external.delegation.partitions == 1
    assert len(_external_buffers(external.tflite)) == 2
    assert _constants(external.tflite) == _constants(inline.tflite)
    blocks = [t for t in external.summary.tensors if t.dtype == "int4"]
    assert [t.block_size for t in blocks] == [128, 128]
    assert [t.scales for t in blocks] == [t.scales for t in inline.summary.tensors if t.dtype == "int4"]
    rows = np.concatenate(data)[:8]
    np.testing.assert_array_equal(litert_rows(external.tflite, rows), litert_rows(inline.tflite, rows))


def test_the_converter_never_sees_the_weights():
    """The StableHLO handed to the converter holds one zero per weight, not its values."""
    model, (x,), variables = mlp()
    prepared = prepare(model, SCHEMAS["int8"], _digits(), variables=variables, progress=False)
    weights = sum(np.size(v) * 4 for v in jax.tree.leaves(variables))  # 680 KB of float32
    inline = _convert.lowered(annotated(model, prepared, variables=variables, external_weights=False).fn,
                              prepared.example_inputs)
    placeholders = _convert.lowered(annotated(model, prepared, variables=variables, external_weights=True).fn,
                                    prepared.example_inputs)
    # A constant of 32 KB or more, as hex: the two large kernels (128 KB, 512 KB).
    constants = re.compile(r'dense<"0x[0-9A-F]{65536,}"')
    assert len(constants.findall(inline)) == 2 and len(inline) > weights
    assert not constants.findall(placeholders) and len(placeholders) < weights / 10


def test_large_quantized_weights_choose_external_weights_by_themselves(monkeypatch):
    model, _, variables = cnn()
    data = _digits()
    assert not _external_buffers(odmlq.export_tflite(model, SCHEMAS["int8"], data, variables=variables,
                                                     progress=False).tflite)
    monkeypatch.setattr(_external, "EXTERNAL_AUTO_BYTES", 16 * 1024)  # the CNN's kernels: 36 KB of float32
    result = odmlq.export_tflite(model, SCHEMAS["int8"], data, variables=variables, progress=False)
    assert len(_external_buffers(result.tflite)) == 4 and result.verification.passed


def test_signatures_share_each_external_weight():
    model, variables, prompts, steps = _decoder.decoder()
    signatures = _decoder.signatures(model, prompts, steps)
    results = {external: odmlq.export_signatures(model, SCHEMAS["dynamic"], signatures, variables=variables,
                                                 external_weights=external, progress=False)
               for external in (False, True)}
    inline, external = results[False].tflite, results[True].tflite
    # Each weight once after the flatbuffer, and every one of them read by both signatures.
    model_t = schema.Model.GetRootAsModel(external, 0)
    readers: dict[int, set[int]] = {}
    for g in range(model_t.SubgraphsLength()):
        graph = model_t.Subgraphs(g)
        for i in range(graph.TensorsLength()):
            readers.setdefault(graph.Tensors(i).Buffer(), set()).add(g)
    placed = [b for b in range(model_t.BuffersLength()) if model_t.Buffers(b).Offset() > 1]
    flat = odmlq.graph.flat_params(variables)
    kernels = [p for p in results[True].signatures["decode"].scales.weights if np.ndim(flat[p]) >= 2]
    assert len(placed) == len(kernels) > 0
    assert all(readers[b] == {0, 1} for b in placed)
    # ... holding the int8 kernels' bytes once.
    assert sum(model_t.Buffers(b).Size() for b in placed) == sum(np.size(flat[p]) for p in kernels)
    assert _constants(external) == _constants(inline)
    for result in results.values():
        assert all(single.verification.passed for single in result.signatures.values())


def test_a_weight_missing_from_the_converted_file_is_an_error_not_zeros():
    model, _, variables = cnn()
    tflite = odmlq.export_tflite(model, SCHEMAS["int8"], _digits(), variables=variables, progress=False).tflite
    ghost = _external.Placeholder("conv9/kernel", (32, 3, 3, 16), "int8", lambda: np.zeros((32, 3, 3, 16)))
    with pytest.raises(OdmlqError, match=r"'conv9/kernel'.*external_weights=False"):
        _external.externalized([tflite], [ghost])


def test_weights_already_after_the_flatbuffer_are_carried_over():
    """A converted file that stores buffers after its flatbuffer (as a converter
    may for a large model) keeps them when the placeholders are written."""
    model, _, variables = cnn()
    data = _digits()
    external = odmlq.export_tflite(model, SCHEMAS["int8"], data, variables=variables, external_weights=True,
                                   progress=False).tflite
    again = _external.externalized([external], [])
    assert len(_external_buffers(again)) == 4
    assert _constants(again) == _constants(external)
    rows = np.concatenate(data)[:8]
    np.testing.assert_array_equal(litert_rows(again, rows), litert_rows(external, rows))
    with pytest.raises(OdmlqError, match="truncated"):
        _external.externalized([external[:-64]], [])


@pytest.mark.slow
def test_a_model_past_2_gb_of_float_weights_exports_and_runs_from_its_path(tmp_path):
    """bench/large_export.py's MLP (2.25 GiB of float32): external weights chosen by
    themselves, the file loaded from its path runs whole on XNNPACK."""
    from bench.large_export import MLP, _params

    model, variables = MLP(8192, 9), _params(8192, 9)
    assert sum(v.nbytes for v in jax.tree.leaves(variables)) > 2 * 10**9
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((4, 8192)).astype(np.float32) for _ in range(3)]
    rules = [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True, weight_algorithm="nearest")]
    path = tmp_path / "large.tflite"
    result = odmlq.export_tflite(model, rules, batches, path, variables=variables, verify=False, progress=False)
    assert result.delegation.partitions == 1 and not result.delegation.outside
    placed = _external_buffers(result.tflite)
    assert len(placed) == 9 and sum(size for _, size in placed) == 9 * 8192 * 8192
    assert min(offset for offset, _ in placed) < 2 * 2**20  # a flatbuffer of biases and scales
    del result
    runner = odmlq.litert.interpreter(str(path), num_threads=2).get_signature_runner()
    x = batches[0][:1]
    out = next(iter(runner(**{next(iter(runner.get_input_details())): x}).values()))
    reference = np.asarray(model.apply(variables, x), np.float64)
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((out - reference) ** 2))
    assert sqnr > 25.0  # measured 30.3 dB: int8 weights per channel, inputs quantized per row
