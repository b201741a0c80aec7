"""ptq on the samples: quantized params in memory, quantized kernels, and simulate's numbers.

Tolerances: static edges are on their grids in both runs and may differ only
where int32 and float32 accumulation round a tie differently: at most 1 LSB
of the edge's scale. Dynamic edges are compared after the same run-time
quantization: 1 LSB of the scale computed from the edge's own range. Models
with float activations (weight-only) match simulate to float32 noise (the
dot sums in another order): rtol 1e-5 of the output's largest magnitude.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq import CalibrationError, PerBlock, PerChannel, PlanError, QArray, Rule
from odmlq.scales import compute_scales
from odmlq.xla import _lowering
from samples.digits import batches, load_digits_splits
from samples.models import SAMPLES

SCHEMAS = {
    "weight_only": [Rule(".*", weight_qtype="int8")],
    "dynamic": [Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
    "dynamic_per_row": [Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True,
                             act_granularity=PerChannel(0))],
    "static": [Rule(".*", weight_qtype="int8", act_qtype="int8")],
}


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


def _setup(name, rules, digits):
    model, (x,), variables = SAMPLES[name]()
    # XLA's own plan: with LiteRT among the targets a dynamic rule keeps the
    # CNN's depthwise convolution (conv1) float (tests/litert/test_speed.py).
    target = "xla" if any(r.act_dynamic for r in rules) else "both"
    plan = odmlq.plan(model, rules, x, variables=variables, target=target)
    calibration = None
    if any(p.spec is not None and not p.spec.dynamic for p in plan.edges.values()):
        calibration = odmlq.calibrate(model, plan, batches(digits.x_calibration, 64), variables=variables)
    return model, variables, plan, calibration


def _kernels(params):
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda v: isinstance(v, QArray))[0]
    return {jax.tree_util.keystr(p): v for p, v in leaves}


# NNX twins trace to the same ops: two schemas by default, all with -m slow.
CASES = [pytest.param(name, schema, id=f"{name}-{schema}",
                      marks=[pytest.mark.slow] if "nnx" in name and schema in ("weight_only", "dynamic_per_row") else [])
         for name in ("mlp", "cnn", "mlp_nnx", "cnn_nnx") for schema in SCHEMAS]


@pytest.mark.parametrize("name,schema", CASES)
def test_samples_run_jitted_on_int8_weights_and_match_simulate(name, schema, digits):
    model, variables, plan, calibration = _setup(name, SCHEMAS[schema], digits)
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    leaves = _kernels(qmodel.params)
    kernels = {k: v for k, v in leaves.items() if "kernel" in k}
    assert len(kernels) == 4 if "cnn" in name else 3
    for path, q in kernels.items():
        assert isinstance(q, QArray) and q.qvalue.dtype == jnp.int8, path
        assert q.qvalue.nbytes == np.prod(q.shape)  # one byte per weight
    floats = sum(np.prod(shape) * 4 for shape, _ in plan.graph.params.values())
    assert qmodel.nbytes < floats / 3.5  # 4x smaller, plus float biases and scales
    expected_kernel = {"weight_only": "weight-only", "static": "int8 x int8 -> int32",
                       "dynamic": "int8 x int8 -> int32", "dynamic_per_row": "int8 x int8 -> int32"}[schema]
    assert all(expected_kernel in low.kernel and low.emulated is None for low in qmodel.lowerings.values())
    assert len(qmodel.lowerings) == len(kernels)

    x = digits.x_test[:50]
    y, edges = jax.jit(lambda p, x: qmodel.apply(p, x, capture=True))(qmodel.params, x)
    scales = compute_scales(plan, calibration, variables if variables is not None else model)
    y_sim, edges_sim = odmlq.simulate(model, plan, scales, x, variables=variables, capture=True)
    if schema == "weight_only":
        np.testing.assert_allclose(y, y_sim, rtol=0, atol=1e-5 * float(np.max(np.abs(y_sim))))
        return
    checked = 0
    for edge_id, ts in scales.edges.items():
        lsb = np.asarray(ts.scale)
        assert np.max(np.abs(np.asarray(edges[edge_id]) - edges_sim[edge_id]) / lsb) <= 1.0 + 1e-3, edge_id
        checked += 1
    for edge_id, edge_plan in plan.edges.items():
        if edge_plan.spec is None or not edge_plan.spec.dynamic or plan.graph.edges[edge_id].alias:
            continue
        x_edge = jnp.asarray(edges[edge_id])
        _, lsb, _ = _lowering._quantize_activation(x_edge, edge_plan.spec, None)
        got = _lowering.dynamic_fake_quant(x_edge, edge_plan.spec)
        assert np.max(np.abs(np.asarray(got) - edges_sim[edge_id]) / np.asarray(lsb)) <= 1.0 + 1e-3, edge_id
        checked += 1
    assert checked >= 3


def test_usable_inside_the_users_jit_at_any_batch_size(digits):
    model, variables, plan, calibration = _setup("cnn", SCHEMAS["static"], digits)
    qmodel = odmlq.ptq(model, plan, variables, calibration)

    @jax.jit
    def serve(params, x):
        return jnp.argmax(qmodel.apply(params, x), axis=-1)

    for batch in (1, 7, 32):
        x = digits.x_test[:batch]
        np.testing.assert_array_equal(serve(qmodel.params, x), jnp.argmax(qmodel(x), axis=-1))


class _Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.relu(nn.Dense(2048, name=f"fc{i}")(x))
        return x


@pytest.mark.parametrize("rules", [SCHEMAS["weight_only"], SCHEMAS["dynamic"]], ids=["weight_only", "dynamic"])
def test_compiled_model_holds_no_float_copy_of_the_weights(rules):
    """XLA's own accounting: arguments are the int8 params (a quarter of the
    float bytes) and scratch space stays below one float layer (16 MiB): weights
    are dequantized block by block, never whole."""
    model, x = _Wide(), jax.ShapeDtypeStruct((1, 2048), jnp.float32)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 2048)))
    qmodel = odmlq.ptq(model, rules, variables, example_inputs=(x,))
    memory = jax.jit(qmodel.apply).lower(qmodel.params, x).compile().memory_analysis()
    float_layer = 2048 * 2048 * 4
    assert memory.argument_size_in_bytes < 4 * float_layer / 3.9
    assert memory.temp_size_in_bytes < float_layer / 2


WEIGHT_ONLY = {
    "int4": (Rule(".*", weight_qtype="int4"), None),
    "int4-block16": (Rule(".*", weight_qtype="int4", weight_granularity=PerBlock(16)), None),
    "fp8": (Rule(".*", weight_qtype="fp8_e4m3"), None),
    "nf4-block16": (Rule(".*", weight_qtype="nf4", weight_granularity=PerBlock(16)), "nf4 is not native on XLA"),
}


@pytest.mark.parametrize("name", list(WEIGHT_ONLY))
def test_weight_only_formats_match_simulate_and_say_when_emulated(name, digits):
    rule, emulated = WEIGHT_ONLY[name]
    # The CNN's first convolution has one input feature: blocks only fit the rest.
    rules = [Rule("conv1", weight_qtype="int8"), rule] if "block" in name else [rule]
    model, variables, plan, _ = _setup("cnn", rules, digits)
    qmodel = odmlq.ptq(model, plan, variables)
    x = digits.x_test[:20]
    y_sim = odmlq.simulate(model, plan, compute_scales(plan, None, variables), x, variables=variables)
    np.testing.assert_allclose(qmodel(x), y_sim, rtol=0, atol=1e-5 * float(np.max(np.abs(y_sim))))
    dense = qmodel.lowerings["dense1/dot_general"]
    assert "weight-only dot" in dense.kernel and dense.emulated == emulated
    assert "weight-only conv" in qmodel.lowerings["conv2/conv"].kernel
    if emulated:  # the plan says so before anything runs, and so does the model
        assert "(emulated on xla/litert)" in str(plan) and "nf4 is not native on XLA" in str(qmodel)


def test_int16_activations_are_emulated_and_say_so(digits):
    model, variables, plan, calibration = _setup("mlp", [Rule(".*", weight_qtype="int8", act_qtype="int16")], digits)
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    assert all(low.emulated == "int16 activations are not native on XLA" for low in qmodel.lowerings.values())
    assert "(emulated on xla)" in str(plan)
    x = digits.x_test[:10]
    y_sim = odmlq.simulate(model, plan, compute_scales(plan, calibration, variables), x, variables=variables)
    np.testing.assert_allclose(qmodel(x), y_sim, rtol=0, atol=1e-5 * float(np.max(np.abs(y_sim))))


def test_params_that_do_not_match_the_plan_are_refused_with_the_paths(digits):
    model, variables, plan, _ = _setup("mlp", SCHEMAS["weight_only"], digits)
    params = {"params": {k: v for k, v in variables["params"].items() if k != "head"}}
    params["params"]["classifier"] = variables["params"]["head"]
    with pytest.raises(PlanError, match=r"missing \(2\): 'head/bias', 'head/kernel'; not in the plan \(2\): "
                                        r"'classifier/bias', 'classifier/kernel'"):
        odmlq.ptq(model, plan, params)


def test_a_static_edge_without_calibration_is_named_with_the_fix(digits):
    model, variables, plan, _ = _setup("mlp", SCHEMAS["weight_only"], digits)
    static = odmlq.plan(model, SCHEMAS["static"], digits.x_test[:1], variables=variables)
    with pytest.raises(CalibrationError, match=r"Edge 'input_0' is quantized statically .* odmlq.calibrate\(.*"
                                               r"act_dynamic=True"):
        odmlq.ptq(model, static, variables)


def test_qarrays_made_for_another_plan_are_refused(digits):
    model, variables, plan, _ = _setup("mlp", [Rule(".*", weight_qtype="int4")], digits)
    int4 = odmlq.quantize_params(variables, plan)
    int8_plan = odmlq.plan(model, SCHEMAS["weight_only"], digits.x_test[:1], variables=variables)
    with pytest.raises(PlanError, match=r"'dense1/kernel' is a QArray quantized as QArray\(int4.*plan asks for int8"):
        odmlq.ptq(model, int8_plan, int4)


def test_rules_need_example_inputs(digits):
    model, _, variables = SAMPLES["mlp"]()
    with pytest.raises(PlanError, match="example_inputs"):
        odmlq.ptq(model, SCHEMAS["weight_only"], variables)


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, carry, _):
                return nn.relu(nn.Dense(16, name="fc")(carry)), None

        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(4, name="head")(x)


def test_stacked_scan_weights_are_emulated_with_the_reason():
    model, x = _Scanned(), jnp.linspace(-1, 1, 32).reshape(2, 16)
    variables = model.init(jax.random.key(0), x)
    qmodel = odmlq.ptq(model, SCHEMAS["weight_only"], variables, example_inputs=(x,))
    assert qmodel.lowerings["layers/fc/dot_general"].emulated.startswith("a stacked weight (nn.scan)")
    assert qmodel.lowerings["head/dot_general"].emulated is None
    plan = qmodel.plan
    y_sim = odmlq.simulate(model, plan, compute_scales(plan, None, variables), x, variables=variables)
    np.testing.assert_allclose(qmodel(x), y_sim, rtol=0, atol=1e-5 * float(np.max(np.abs(y_sim))))


def test_static_plan_of_a_scanned_model_calibrates_and_simulates():
    """Hooks see every iteration of an nn.scan body (the scan is unrolled when
    hooked): calibration statistics cover all layers, no tracer escapes."""
    model, x = _Scanned(), jnp.linspace(-1, 1, 32).reshape(2, 16)
    variables = model.init(jax.random.key(0), x)
    plan = odmlq.plan(model, SCHEMAS["static"], x, variables=variables)
    calibration = odmlq.calibrate(model, plan, [x, 0.5 * x], variables=variables)
    body_edges = [e for e in calibration if e.startswith("layers/")]
    assert body_edges, list(calibration)
    # The body edge's range is that of all three layers' outputs, not the last one's.
    per_layer = []

    def keep(edge_id, value):
        if edge_id == body_edges[0]:
            per_layer.append(np.asarray(value))
        return value

    plan.graph.evaluate(variables, x, on_edge=keep)
    assert len(per_layer) == 3
    lo, hi = calibration.range(body_edges[0], "int8", symmetric=False)
    assert float(hi) >= max(float(v.max()) for v in per_layer) - 1e-6
    scales = compute_scales(plan, calibration, variables)
    y = np.asarray(odmlq.simulate(model, plan, scales, x, variables=variables))
    f = np.asarray(model.apply(variables, x))
    # int8 activations and weights on a 3-layer net: > 25 dB from float.
    assert 10 * np.log10(np.sum(f ** 2) / np.sum((y - f) ** 2)) > 25


def test_any_batch_size_with_constants_computed_in_the_model():
    """Positions from jnp.arange are folded at trace time; tracing again for
    another batch size inside the jitted call must fold them eagerly too
    (seen: TracerArrayConversionError on a language model at batch 7)."""
    import flax.linen as nn

    class Lm(nn.Module):
        @nn.compact
        def __call__(self, ids):
            positions = jnp.arange(ids.shape[1])
            h = nn.Embed(50, 8, name="tokens")(ids) + nn.Embed(16, 8, name="positions")(positions)[None]
            return nn.Dense(4, name="head")(h)

    ids = np.random.RandomState(0).randint(0, 50, size=(7, 16)).astype(np.int32)
    model = Lm()
    variables = model.init(jax.random.PRNGKey(0), ids[:1])
    qmodel = odmlq.ptq(model, [odmlq.Rule(".*", weight_qtype="int8")], variables, example_inputs=(ids[:1],))
    y = qmodel(ids)
    assert y.shape == (7, 16, 4)
    y_sim = odmlq.simulate(model, qmodel.plan, qmodel.scales, ids, variables=variables)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_sim), rtol=1e-5, atol=1e-6)  # float32 order


class _Tied(nn.Module):
    """A tied embedding: looked up for the input, read transposed as the output projection."""

    vocab: int = 300

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, 96, name="embedding")
        h = nn.relu(nn.Dense(96, name="mix")(embed(tokens)))
        return embed.attend(h)


@pytest.mark.parametrize("schema", ["weight_only", "dynamic"])
@pytest.mark.parametrize("vocab", [300, 96], ids=["vocab-300", "square"])
def test_a_tied_embedding_read_transposed_runs_on_the_stored_weight(schema, vocab):
    """The output projection reads the (vocab, hidden) table as (hidden, vocab): lowered
    on the table as stored (blocks of its rows), not emulated on a dequantized copy.
    Weight-only matches simulate to float32 noise; dynamic int8 sums the same integers
    and scales in the same order as simulate, so it is equal. The square table is int8
    per vocabulary row (one scale per output of the projection)."""
    model = _Tied(vocab)
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 5)).astype(np.int32)
    variables = model.init(jax.random.key(0), tokens)
    rules = [Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)] if schema == "dynamic" \
        else [Rule(".*", weight_qtype="int8")]
    if vocab == 96:
        rules = [dataclasses.replace(rules[0], module_path="embedding", weight_granularity=PerChannel(0))] + rules
    plan = odmlq.plan(model, rules, tokens, variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, [tokens], variables=variables, progress=False)
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    attend = [r for op, r in qmodel.lowerings.items() if op.startswith("embedding/")]
    assert len(attend) == 1 and attend[0].emulated is None and "as stored (N, K)" in attend[0].kernel
    got = np.asarray(jax.jit(qmodel.apply)(qmodel.params, tokens))
    expected = np.asarray(odmlq.simulate(model, plan, calibration, tokens, variables=variables))
    if schema == "dynamic":
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_params_already_quantized_are_kept_when_a_required_algorithm_has_no_float_weight_left():
    """A decoder's decode method reuses the params its prefill quantized: with GPTQ
    required, nothing is left for GPTQ to round, so ptq keeps the QArrays as they are."""
    model = _Tied()
    tokens = np.random.default_rng(0).integers(0, 300, (2, 5)).astype(np.int32)
    variables = model.init(jax.random.key(0), tokens)
    rules = [Rule("mix", weight_qtype="int8", weight_algorithm=odmlq.GPTQ(required=True))]
    plan = odmlq.plan(model, rules, tokens, variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, [tokens], variables=variables, progress=False)
    first = odmlq.ptq(model, plan, variables, calibration)
    again = odmlq.ptq(model, plan, first.params, calibration)
    for a, b in zip(jax.tree.leaves(first.params, is_leaf=lambda x: isinstance(x, QArray)),
                    jax.tree.leaves(again.params, is_leaf=lambda x: isinstance(x, QArray))):
        assert a is b or np.array_equal(np.asarray(a.values() if isinstance(a, QArray) else a),
                                        np.asarray(b.values() if isinstance(b, QArray) else b))
