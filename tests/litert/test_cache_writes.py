"""A decoder's KV-cache write, full integer: one new row put into a cache that
crosses the model's boundary (an input, and an output the next step reads).

Two forms, as decoders write them: a select of the row against the position
(``jnp.where``, the sample decoder's; the row broadcast over the cache's
positions, past the 16 copies a concatenation takes, is a MUL by ones:
`odmlq/graph/_canonical.py`), and ``lax.dynamic_update_slice`` (transformers'
Flax decoders). In both the row is copied in at the cache's scale: rows not
written come back as they went in, to half a step of that scale (one QUANTIZE
and one DEQUANTIZE), and the export verifies every op against simulate.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _selected(cache, row, position):
    here = jnp.arange(cache.shape[1], dtype=jnp.int32)[None, :] == position[:, None]
    return jnp.where(here[:, :, None], row, cache)


def _updated(cache, row, position):
    return jax.lax.dynamic_update_slice(cache, row, (0, position[0], 0))


class _CacheWrite(nn.Module):
    """A new row (a dense layer's output) written into `cache` at `position`, and read."""

    write: object

    @nn.compact
    def __call__(self, x, cache, position):
        cache = self.write(cache, nn.Dense(cache.shape[-1], name="fc")(x)[:, None, :], position)
        return nn.Dense(8, name="out")(cache.reshape(cache.shape[0], -1)), cache


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 12)).astype(np.float32)
    cache = rng.normal(size=(16, 32, 16)).astype(np.float32)
    position = rng.integers(0, 32, size=(16,)).astype(np.int32)
    return [(x[i:i + 1], cache[i:i + 1], position[i:i + 1]) for i in range(16)]


@pytest.mark.parametrize("write,kernel", [(_selected, {"SELECT", "SELECT_V2"}),
                                          (_updated, {"DYNAMIC_UPDATE_SLICE"})], ids=["select", "update_slice"])
def test_a_row_written_into_a_cache_exports_full_integer(write, kernel):
    model = _CacheWrite(write)
    data = _data()
    variables = model.init(jax.random.key(0), *data[0])
    result = odmlq.export_tflite(model, INT8, data, variables=variables, benchmark=False)
    histogram = dict(result.summary.op_histogram)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert "BROADCAST_TO" not in histogram and kernel & set(histogram), histogram
    assert result.verification.passed, str(result.verification)
    x, cache, position = data[0]
    out = odmlq.litert.interpreter(result.tflite).get_signature_runner()(x=x, cache=cache, position=position)
    step = float(np.max(result.scales.edges[result.plan.graph.outputs[1]].scale))
    kept = np.arange(32) != position[0]
    assert np.max(np.abs(out["output_1"][0, kept] - cache[0, kept])) <= step / 2 * (1 + 1e-6)
    # The written row is simulate's (the dense layer's int8 output copied onto the cache's grid),
    # to one step of the cache's scale.
    simulated = odmlq.simulate(model, result.plan, result.calibration, x, cache, position, variables=variables)[1]
    row = position[0]
    assert np.max(np.abs(out["output_1"][0, row] - np.asarray(simulated)[0, row])) <= step * (1 + 1e-6)


@pytest.mark.parametrize("write", [_selected, _updated], ids=["select", "update_slice"])
def test_xla_writes_the_cache_as_simulate_does(write):
    model = _CacheWrite(write)
    data = _data()
    variables = model.init(jax.random.key(0), *data[0])
    plan = odmlq.plan(model, INT8, *data[0], variables=variables)
    calibration = odmlq.calibrate(model, plan, data, variables=variables)
    xla = odmlq.ptq(model, plan, variables, calibration)
    for inputs in data[:4]:
        simulated = odmlq.simulate(model, plan, calibration, *inputs, variables=variables)
        for a, b in zip(xla(*inputs), simulated):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_int16_update_slice_is_refused_by_name():
    """litert-converter 0.5.0 takes no int16 operand for DYNAMIC_UPDATE_SLICE."""
    model = _CacheWrite(_updated)
    data = _data()
    variables = model.init(jax.random.key(0), *data[0])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
    with pytest.raises(odmlq.OdmlqError, match="dynamic_update_slice"):
        odmlq.export_tflite(model, rules, data, variables=variables, benchmark=False)
