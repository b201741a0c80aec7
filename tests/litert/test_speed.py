"""Delegation and speed: which ops XNNPACK runs, refused or warned about, and
the latency of an export against its float twin (real converter, real
interpreter; untrained weights, since only where ops run is asserted)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.litert import DelegateError, _convert
from odmlq.litert._annotate import dynamic_range_composite
from odmlq.litert.export import _check_summary
from samples.models import cnn, mlp

R = odmlq.Rule
DYNAMIC = [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]


class SelfAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(16, name=n)(x) for n in "qkv")
        weights = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) * 0.25)
        return nn.Dense(16, name="out")(jnp.einsum("bqk,bkd->bqd", weights, v))


def _batches(shape, n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(8, *shape)).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def attention():
    model = SelfAttention()
    return model, model.init(jax.random.key(0), jnp.zeros((1, 6, 16)))


def _matmuls(plan):
    return [op.id for op in plan.graph.ops if "einsum" in op.id]


def test_activation_matmuls_read_dynamic_inputs_in_float_for_litert(attention):
    """LiteRT's dynamic-range kernels need an int8 constant weight: the plan
    keeps an attention matmul's inputs float on every backend planned with it."""
    model, variables = attention
    x = np.zeros((1, 6, 16), np.float32)
    both = odmlq.plan(model, DYNAMIC, x, variables=variables)
    xla = odmlq.plan(model, DYNAMIC, x, variables=variables, target="xla")
    assert len(_matmuls(both)) == 2
    assert all(both.ops[o].dynamic_inputs_float for o in _matmuls(both))
    assert not any(xla.ops[o].dynamic_inputs_float for o in _matmuls(xla))
    assert not any(both.ops[o].dynamic_inputs_float for o in both.ops if o not in _matmuls(both))
    again = odmlq.Plan.from_json(both.to_json())
    assert all(again.ops[o].dynamic_inputs_float for o in _matmuls(both))


def test_dynamic_attention_exports_without_composites_in_one_partition(attention):
    """Before the plan said so, each attention matmul kept two identity
    STABLEHLO_COMPOSITE markers that split the graph (5 partitions on BERT)."""
    model, variables = attention
    result = odmlq.export_tflite(model, DYNAMIC, _batches((6, 16)), variables=variables)
    assert "STABLEHLO_COMPOSITE" not in result.summary.op_histogram
    assert result.delegation.partitions == 1 and result.delegation.outside == ()
    # The float attention matmuls are what simulate computes too: 30 dB is the
    # dynamic schema's floor (per-row kernels against simulate's per-tensor).
    assert result.verification.passed and result.verification.output_sqnr_db >= 30


def test_a_composite_left_in_the_model_is_refused():
    """A marker the converter did not lower (what the attention matmuls of a
    dynamic plan made before) stops the export, naming its module."""
    def fn(q, k):
        with jax.named_scope("attention/scores"):
            return jnp.einsum("bqd,bkd->bqk", dynamic_range_composite(q), dynamic_range_composite(k))

    x = np.ones((1, 4, 8), np.float32)
    tflite = _convert.convert(fn, (x, x), input_names=["q", "k"], output_names=["y"], dynamic_range=True)
    summary = odmlq.litert.inspect(tflite)
    assert summary.op_histogram.get("STABLEHLO_COMPOSITE") == 2
    with pytest.raises(odmlq.litert.ConversionError, match=r"STABLEHLO_COMPOSITE.*attention/scores.*skip=True"):
        _check_summary("dynamic", summary, allow_float_ops=False, float_ops=[])


def test_full_integer_cnn_runs_whole_on_xnnpack():
    model, (x,), variables = cnn()
    result = odmlq.export_tflite(model, [R(".*", weight_qtype="int8", act_qtype="int8")],
                                 _batches(x.shape[1:]), variables=variables, require_delegate=True)
    found = result.delegation
    assert found.partitions == 1 and found.outside == ()
    assert found.delegated == len(result.summary.ops)
    assert "XNNPACK: 1 partition" in str(result)


def test_int16x8_matmuls_off_the_delegate_warn_and_can_be_refused():
    """XNNPACK has no 16x8 FULLY_CONNECTED: the export says so by default and
    refuses with require_delegate, naming the op and its module."""
    model, (x,), variables = mlp()
    rules = [R(".*", weight_qtype="int8", act_qtype="int16")]
    with pytest.warns(UserWarning, match=r"FULLY_CONNECTED \(module 'dense1.*slower than its float twin"):
        result = odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False)
    outside = {op.name for op in result.delegation.outside}
    assert "FULLY_CONNECTED" in outside and result.delegation.compute_outside
    with pytest.raises(DelegateError, match=r"require_delegate=True.*FULLY_CONNECTED \(module 'dense1"):
        odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False,
                            require_delegate=True)


def test_benchmark_times_the_float_twin_and_warns_only_when_slower():
    model, (x,), variables = mlp()
    for rules in ([R(".*", weight_qtype="int8", act_qtype="int8")], [R(".*", weight_qtype="int8", act_qtype="int16")]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False,
                                         benchmark=True)
        latency = result.latency
        assert latency.ms > 0 and latency.float_ms > 0 and latency.threads == 1
        assert [timed.threads for timed in result.latencies] == list(odmlq.litert.speed.benchmark_threads())
        assert result.latencies[0] == latency
        slower = [w for w in caught if "than its float twin on this machine" in str(w.message)]
        assert bool(slower) == any(timed.maybe_slower for timed in result.latencies), \
            (result.latencies, [str(w.message) for w in caught])
        for timed in result.latencies:
            assert timed.rounds == 11 and 0 <= timed.slower_rounds <= timed.rounds
            assert timed.maybe_slower == (timed.vs_float > 1.0 or 3 * timed.slower_rounds >= timed.rounds)
        assert "x float" in str(result)


def test_a_small_model_is_timed_against_float_by_default():
    """A quantized model of few weights is where per-op costs and small int8
    kernels can make it slower than float with every op on XNNPACK (the
    digits CNN's int8 file ran 1.2-1.5x float on one host, 0.55x on
    another): the export times it unless told not to, and says so when it is
    slower."""
    model, (x,), variables = cnn()
    rules = [R(".*", weight_qtype="int8", act_qtype="int8")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False)
    assert result.delegation.partitions == 1 and not result.delegation.outside
    assert [x.threads for x in result.latencies] == list(odmlq.litert.speed.benchmark_threads())
    slower = [str(w.message) for w in caught if "than its float twin on this machine" in str(w.message)]
    assert bool(slower) == any(x.maybe_slower for x in result.latencies), (result.latencies, slower)
    for message in slower:
        assert "skip=True" in message and "max_latency_ratio" in message and "benchmark=False" in message, message
    for line in str(result).splitlines()[2:]:
        assert "XNNPACK" in line or "x float" in line, str(result)
    # The float twin is not timed against itself.
    assert odmlq.export_tflite(model, [], _batches(x.shape[1:]), variables=variables, verify=False).latency is None


def test_benchmark_false_or_a_large_model_claims_no_latency(monkeypatch):
    model, (x,), variables = mlp()
    rules = [R(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False,
                                 benchmark=False)
    assert result.latency is None and result.latencies == () and result.delegation.partitions == 1
    # Over the size where the default times the model (the MLP is 0.6 MB of float weights): not timed.
    monkeypatch.setattr(odmlq.litert.export, "AUTO_BENCHMARK_BYTES", 500_000)
    result = odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False)
    assert result.latency is None and "x float" not in str(result)
    monkeypatch.setattr(odmlq.litert.export, "AUTO_BENCHMARK_BYTES", 700_000)
    assert odmlq.export_tflite(model, rules, _batches(x.shape[1:]), variables=variables, verify=False).latency


def test_int4_dynamic_convolutions_are_refused_before_any_work():
    """LiteRT's hybrid convolutions take int8 filters only: an int4 one exported
    and then failed at its first invoke with a bare RuntimeError."""
    model, (x,), variables = cnn()
    # (conv1, a depthwise convolution, keeps float weights in dynamic plans.)
    with pytest.raises(odmlq.PlanError, match=r"conv2/conv.*int4 in a dynamic-range convolution.*op='conv'"):
        odmlq.export_tflite(model, [R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True)],
                            _batches(x.shape[1:]), variables=variables)
    # What the error suggests: int8 convolutions, int4 elsewhere.
    result = odmlq.export_tflite(model, [R(".*", op="conv", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
                                         R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True)],
                                 _batches(x.shape[1:]), variables=variables)
    assert result.verification.passed


def test_dynamic_depthwise_convolutions_keep_float_weights_where_litert_is_a_target():
    """LiteRT's hybrid depthwise kernel runs outside XNNPACK (the digits CNN's
    conv1 split the graph); the plan keeps that weight float and says why."""
    model, (x,), variables = cnn()
    both = odmlq.plan(model, DYNAMIC, x, variables=variables)
    xla = odmlq.plan(model, DYNAMIC, x, variables=variables, target="xla")
    kernel = {p.param: p for o in both.ops.values() for p in o.weights}["conv1/kernel"]
    assert kernel.spec is None and "outside XNNPACK" in kernel.note
    assert {p.param: p for o in xla.ops.values() for p in o.weights}["conv1/kernel"].spec is not None
    assert {p.param: p for o in both.ops.values() for p in o.weights}["conv2/kernel"].spec is not None
    result = odmlq.export_tflite(model, both, _batches(x.shape[1:]), variables=variables)
    assert result.delegation.partitions == 1 and result.delegation.outside == ()
