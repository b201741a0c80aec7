"""State across calls (`state={input: output}`): a decoder's KV cache kept int8 between XLA decode steps."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.errors import PlanError
from samples.decoder_model import Decoder, DecoderConfig

R = odmlq.Rule
CONFIG = DecoderConfig(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, mlp_hidden=48, cache_length=16)
CACHE = R(".*attention", op="select_n", writes_output=True, act_qtype="int8")
WEIGHTS = R(".*", op="dot_general", weight_qtype="int8", weight_algorithm=odmlq.Nearest())


@pytest.fixture(scope="module")
def decoder():
    model = Decoder(CONFIG)
    variables = model.init(jax.random.key(0), np.zeros((1, 4), np.int32))
    rng = np.random.default_rng(0)
    steps = []  # the cache as the float model fills it, a few positions on
    for row in range(4):
        cache = model.empty_cache(1)
        tokens = rng.integers(0, 256, (1, 6)).astype(np.int32)
        _, *cache = model.apply(variables, tokens, *cache, method="prefill")
        for position in range(6, 9):
            token = rng.integers(0, 256, (1, 1)).astype(np.int32)
            steps.append((token, np.array([position], np.int32), *(np.asarray(x) for x in cache)))
            _, *cache = model.apply(variables, token, steps[-1][1], *cache, method="decode")
    return model, variables, steps


def _quantized(decoder, rules, granularity=None):
    model, variables, steps = decoder
    if granularity is not None:
        rules = [R(CACHE.module_path, op="select_n", writes_output=True, act_qtype="int8",
                   act_granularity=granularity), *rules[1:]]
    plan = odmlq.plan(model, rules, *steps[0], variables=variables, method="decode", target="xla",
                      state=model.decode_state())
    calibration = odmlq.calibrate(model, plan, steps, variables=variables, progress=False)
    return plan, odmlq.ptq(model, plan, variables, calibration)


def test_the_plan_names_each_pair_and_keeps_it_through_json_and_replanning(decoder):
    model, _, _ = decoder
    plan, _ = _quantized(decoder, [CACHE, WEIGHTS])
    graph = plan.graph
    assert plan.state == tuple((graph.inputs[i], graph.outputs[o]) for i, o in model.decode_state().items())
    assert plan.state_indices == model.decode_state()
    assert odmlq.Plan.from_json(plan.to_json()).state == plan.state
    assert plan.replan([CACHE]).state == plan.state
    for source, result in plan.state:
        assert plan.edges[source].spec == plan.edges[graph.resolve(result)].spec
        assert plan.edges[source].spec.qtype.name == "int8"


@pytest.mark.parametrize("granularity", [None, odmlq.PerChannel(3)])
def test_the_int8_cache_crosses_steps_as_codes_and_equals_simulate(decoder, granularity):
    # Decode steps fed their own QArray caches give simulate's cache to 0 LSB (the same
    # integers: the codes path chooses codes where simulate rounds the chosen floats) and
    # its logits to float32 noise of the weight-only matmuls' order of sums (1e-5 relative).
    model, variables, steps = decoder
    plan, qmodel = _quantized(decoder, [CACHE, WEIGHTS], granularity)
    simulated = odmlq.Simulator(model, plan, qmodel.scales, variables=variables)
    token, position, *cache = steps[0]
    first = qmodel(token, position, *cache)  # a float cache is taken on the first step
    kept, reference = list(first[1:]), [np.asarray(x) for x in simulated(token, position, *cache)[1:]]
    for q in kept:
        assert isinstance(q, odmlq.QArray) and q.qvalue.dtype == np.int8
    assert sum(q.qvalue.nbytes for q in kept) * 4 == sum(x.nbytes for x in cache)  # codes: a byte each
    for step in range(4):
        position = np.array([9 + step], np.int32)
        out = qmodel(token, position, *kept)
        want = simulated(token, position, *reference)
        kept, reference = list(out[1:]), [np.asarray(x) for x in want[1:]]
        for q, x, (source, _) in zip(kept, reference, plan.state):
            lsb = np.asarray(qmodel.scales.edges[source].scale)
            assert np.max(np.abs(np.asarray(q.dequantize()) - x) / lsb) == 0.0
        logits, expected = np.asarray(out[0]), np.asarray(want[0])
        assert np.max(np.abs(logits - expected)) <= 1e-5 * np.max(np.abs(expected))
    # Jitted by the caller too: the same codes.
    jitted = jax.jit(qmodel.apply)(qmodel.params, token, position, *kept)
    assert all(np.array_equal(a.qvalue, b.qvalue) for a, b in zip(jitted[1:], qmodel(token, position, *kept)[1:]))


def test_a_cache_read_through_the_codes_stays_close_to_float(decoder):
    # The int8 cache's whole effect on a step's logits is small against their spread: 30 dB
    # SQNR is about 3% RMS error, what 8-bit keys and values leave after softmax.
    model, variables, steps = decoder
    _, qmodel = _quantized(decoder, [CACHE])
    errors, signal = [], []
    for token, position, *cache in steps:
        want = np.asarray(model.apply(variables, token, position, *cache, method="decode")[0])
        got = np.asarray(qmodel(token, position, *cache)[0])
        errors.append(got - want)
        signal.append(want)
    sqnr = 10 * np.log10(np.sum(np.square(signal)) / np.sum(np.square(errors)))
    assert sqnr >= 30.0, sqnr


def test_a_qarray_where_no_state_is_quantized_or_at_another_scale_is_refused(decoder):
    model, variables, steps = decoder
    plan, qmodel = _quantized(decoder, [CACHE, WEIGHTS])
    token, position, *cache = steps[0]
    out = qmodel(token, position, *cache)
    with pytest.raises(PlanError, match="another scale"):
        other = odmlq.quantize(np.asarray(cache[0]) + 1.0, "int8", scale=np.float32(0.5), zero_point=np.int32(0))
        qmodel(token, position, other, *out[2:])
    plain = odmlq.ptq(model, [WEIGHTS], variables, example_inputs=steps[0], method="decode", target="xla")
    with pytest.raises(PlanError, match="only quantized state.inputs"):
        plain(token, position, *out[1:])


def test_state_pairs_that_cannot_be_one_tensor_are_refused_by_name(decoder):
    model, variables, steps = decoder
    with pytest.raises(PlanError, match="not among the model.s 5 outputs"):
        odmlq.plan(model, [CACHE], *steps[0], variables=variables, method="decode", state={2: 7})
    with pytest.raises(PlanError, match="are not one tensor .or pytree of tensors. across calls"):
        odmlq.plan(model, [CACHE], *steps[0], variables=variables, method="decode", state={2: 0})
    with pytest.raises(PlanError, match="fed back as input 2 and as input 3"):
        odmlq.plan(model, [CACHE], *steps[0], variables=variables, method="decode", state={2: 1, 3: 1})


def test_a_state_read_in_float_and_written_in_int8_is_refused_naming_both_ops():
    def step(params, x, cache):  # the cache read by a float MUL, written by an int8 ADD
        return x.sum(), cache * params["decay"] + x

    x, cache = np.ones((2, 4), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(PlanError, match="read by 'mul'.*written by 'add'.*would cross calls as float but is written as int8"):
        odmlq.plan(step, [R("", op="add", act_qtype="int8")], x, cache, variables={"decay": np.float32(0.5)},
                   state={1: 1})


class _UpdatedCache(nn.Module):
    """A cache written with lax.dynamic_update_slice (transformers' Flax decoders' form)."""

    @nn.compact
    def __call__(self, x, position, cache):  # x (1, 1, 16), position (1,), cache (1, 8, 16)
        new = nn.Dense(16, use_bias=False)(x)
        cache = jax.lax.dynamic_update_slice(cache, new, (0, position[0], 0))
        return jnp.einsum("bqd,bkd->bqk", x, cache), cache


def test_a_cache_written_by_dynamic_update_slice_stays_codes_and_equals_simulate():
    model, rng = _UpdatedCache(), np.random.default_rng(1)
    x, cache = rng.normal(size=(1, 1, 16)).astype(np.float32), np.zeros((1, 8, 16), np.float32)
    variables = model.init(jax.random.key(0), x, np.array([0], np.int32), cache)
    data = []
    for position in range(6):
        data.append((rng.normal(size=(1, 1, 16)).astype(np.float32), np.array([position], np.int32), cache))
        cache = np.asarray(model.apply(variables, *data[-1])[1])
    rules = [R(".*", op="dynamic_update_slice", writes_output=True, act_qtype="int8")]
    plan = odmlq.plan(model, rules, *data[0], variables=variables, target="xla", state={2: 1})
    qmodel = odmlq.ptq(model, plan, variables, odmlq.calibrate(model, plan, data, variables=variables,
                                                               progress=False))
    simulated = odmlq.Simulator(model, plan, qmodel.scales, variables=variables)
    kept, reference = np.zeros((1, 8, 16), np.float32), np.zeros((1, 8, 16), np.float32)
    lsb = np.asarray(qmodel.scales.edges[plan.state[0][0]].scale)
    for step, (x, position, _) in enumerate(data):
        (scores, kept), (want, reference) = qmodel(x, position, kept), simulated(x, position, reference)
        assert isinstance(kept, odmlq.QArray)
        assert np.max(np.abs(np.asarray(kept.dequantize()) - np.asarray(reference)) / lsb) == 0.0, step
        np.testing.assert_allclose(np.asarray(scores), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_a_transformers_flax_gpt2_keeps_its_own_cache_int8_between_steps():
    # transformers' Flax GPT-2 keeps its cache in a Flax collection (a dict of per-layer keys,
    # values and a write index) written by lax.dynamic_update_slice: state={3: 1} pairs the
    # dict argument with the dict it returns, leaf by leaf (the int32 index stays as it is).
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    hf = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2), seed=0)
    module, params = hf.module, hf.params

    def step(params, token, position, mask, cache):
        out, new = module.apply({"params": params, "cache": cache}, token, mask, position, init_cache=False,
                                deterministic=True, mutable=["cache"])
        return out.logits, new["cache"]

    def inputs(position, token):
        mask = np.zeros((1, 16), np.int32)
        mask[0, :position + 1] = 1
        return np.array([[token]], np.int32), np.array([[position]], np.int32), mask

    rng, empty = np.random.default_rng(0), hf.init_cache(1, 16)
    data, cache = [], empty
    for position in range(3, 9):
        data.append((*inputs(position, int(rng.integers(0, 128))), cache))
        cache = step(params, *data[-1])[1]
    rules = [R(".*", op="dynamic_update_slice", writes_output=True, act_qtype="int8"),
             R(".*", op="dot_general", weight_qtype="int8", weight_algorithm=odmlq.Nearest())]
    plan = odmlq.plan(step, rules, *data[0], variables=params, target="xla", state={3: 1})
    assert len(plan.state) == 6 and plan.state_indices == {3: 1}
    qmodel = odmlq.ptq(step, plan, params, odmlq.calibrate(step, plan, data, variables=params, progress=False))
    simulated = odmlq.Simulator(step, plan, qmodel.scales, variables=params)
    kept, reference = empty, empty
    for position in range(3, 9):
        (logits, kept), (want, reference) = (qmodel(*inputs(position, 7 + position), kept),
                                             simulated(*inputs(position, 7 + position), reference))
        layer = kept["transformer"]["h"]["0"]["attn"]
        assert isinstance(layer["cached_key"], odmlq.QArray) and not isinstance(layer["cache_index"], odmlq.QArray)
        for got, expected in zip(jax.tree.leaves(kept, is_leaf=lambda x: isinstance(x, odmlq.QArray)),
                                 jax.tree.leaves(reference)):
            got = got.dequantize() if isinstance(got, odmlq.QArray) else got
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))  # the same integers
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-6)
