"""Models whose inputs and outputs are dicts and lists (a tokenizer's
`{'input_ids', 'attention_mask'}` batch, a dict of heads), as users write them.

Before, `export_tflite` refused every such batch ("each batch is an array or
a tuple of arrays"), and re-tracing a dict input at the calibration batch size
crashed with a bare AttributeError. Now the .tflite takes the leaves in
`jax.tree` order, named after their keys, and verifies like any export.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

import odmlq
from odmlq.batches import leaf_names, leaves
from odmlq.errors import CalibrationError

_INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class _Encoder(nn.Module):
    """Token ids and a mask in one dict; a dict of two heads out."""

    @nn.compact
    def __call__(self, batch):
        h = nn.Embed(50, 16)(batch["input_ids"])
        mask = batch["attention_mask"][..., None].astype(jnp.float32)
        h = nn.relu(nn.Dense(16)(h))
        pooled = (h * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
        return {"pooled": pooled, "logits": nn.Dense(3)(pooled)}


def _tokens(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.integers(2, 7, size=8)
        mask = (np.arange(6)[None] < lengths[:, None]).astype(np.int32)
        out.append({"input_ids": (rng.integers(1, 50, (8, 6)) * mask).astype(np.int32), "attention_mask": mask})
    return out


def test_a_tokenizer_dict_in_and_a_dict_of_heads_out_export_int8(tmp_path):
    model = _Encoder()
    data = _tokens(4, 0)
    variables = model.init(jax.random.key(0), data[0])
    path = tmp_path / "encoder.tflite"
    result = odmlq.export_tflite(model, _INT8, data, str(path), variables=variables, benchmark=False)
    assert result.summary.schema == "static" and not result.summary.float_islands
    interpreter = Interpreter(model_path=str(path))
    runner = interpreter.get_signature_runner()
    assert sorted(runner.get_input_details()) == ["attention_mask", "input_ids"]
    # The file's outputs are the model's output leaves in jax.tree order
    # (logits, then pooled): the interpreter's outputs against simulate's,
    # within one int8 step of each output (the verified op tolerance).
    (batch,) = _tokens(1, 9)
    expected = leaves(odmlq.simulate(model, result.plan, result.scales, batch, variables=variables))
    for row in range(2):
        got = runner(**{k: v[row:row + 1] for k, v in batch.items()})
        for i, want in enumerate(expected):
            details = runner.get_output_details()[f"output_{i}"]
            scale, zero = details["quantization"]
            value = got[f"output_{i}"]
            value = (value.astype(np.float32) - zero) * scale if scale else value
            assert value.shape == want[row:row + 1].shape
            step = scale or float(np.max(np.abs(want))) / 127
            assert np.max(np.abs(value - want[row:row + 1])) <= 1.01 * step


@pytest.mark.parametrize("rules", [_INT8, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8",
                                                      act_dynamic=True)]], ids=["int8", "dynamic"])
def test_two_inputs_a_dict_and_a_list_export_with_integer_io(rules, tmp_path):
    class Two(nn.Module):
        @nn.compact
        def __call__(self, feats, extra):
            h = nn.Dense(16)(feats["x"]) * extra[1] + nn.Dense(16)(extra[0])
            return nn.Dense(4)(nn.relu(h))

    rng = np.random.default_rng(0)
    data = [({"x": rng.standard_normal((8, 8)).astype(np.float32)},
             [rng.standard_normal((8, 5)).astype(np.float32), rng.random((8, 1)).astype(np.float32)])
            for _ in range(4)]
    model = Two()
    variables = model.init(jax.random.key(0), *data[0])
    io = {"io_dtype": "int8"} if not rules[0].act_dynamic else {}
    result = odmlq.export_tflite(model, rules, data, str(tmp_path / "two.tflite"), variables=variables,
                                 benchmark=False, **io)
    names = sorted(Interpreter(model_content=result.tflite).get_signature_runner().get_input_details())
    assert names == ["extra_0", "extra_1", "feats_x"]
    # compare runs the .tflite on the same pytree inputs.
    report = odmlq.compare(model, result.plan, result.scales, *data[0], variables=variables,
                           tflite=result.tflite)
    assert any("litert" in name for name in report.outputs)


def test_leaf_names_follow_the_keys_and_stay_unique():
    inputs = ({"a": 0, "b": {"c": 1}}, [2, 3])
    assert leaf_names(inputs, ["x", "y"]) == ["x_a", "x_b_c", "y_0", "y_1"]
    assert leaf_names(({"input ids": 0, "input_ids": 1},), ["batch"]) == ["input_ids", "input_ids_1"]
    assert leaf_names((np.zeros(2),), ["tokens"]) == ["tokens"]


def test_a_leaf_that_is_not_an_array_is_named_by_its_key():
    model = _Encoder()
    (good,) = _tokens(1, 0)
    variables = model.init(jax.random.key(0), good)
    bad = dict(good, attention_mask="all")
    with pytest.raises(CalibrationError, match=r"input 0\['attention_mask'\]: str"):
        odmlq.export_tflite(model, _INT8, [bad], variables=variables)
    short = dict(good, attention_mask=good["attention_mask"][:4])
    with pytest.raises(CalibrationError, match=r"same number of rows"):
        odmlq.export_tflite(model, _INT8, [short], variables=variables)
