"""Inference BatchNorm folded into the convolution or dense layer before it.

Tolerances: the traced graph evaluates the model's own primitives, so it is
bit-exact with `model.apply`; folding rescales the kernel and moves the
BatchNorm into the bias, which reorders float32 operations (rtol 1e-5).
Exports are checked op by op by `verify` (1 LSB) and against float by
output SQNR (30 dB, the floor the export itself applies).
"""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import odmlq
from odmlq.graph import fold_params, folded_bias, folded_operands, folded_ops, operand_values

RNG = np.random.RandomState(0)
X = RNG.rand(48, 8, 8, 3).astype(np.float32)
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class ConvBn(nn.Module):
    conv_bias: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), use_bias=self.conv_bias, name="conv")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True, name="bn")(x))
        x = nn.Dense(16, name="dense")(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=True, name="bn_dense")(x)
        return nn.Dense(4, name="head")(nn.relu(x))


class NnxConvBn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


def _realistic(tree, rng):
    """BatchNorm statistics and affine parameters away from their identity init."""
    def visit(path, leaf):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        c = np.shape(leaf)[-1] if np.ndim(leaf) else 1
        if name.endswith("mean"):
            return jnp.asarray(rng.randn(c) * 0.3, leaf.dtype)
        if name.endswith("var"):
            return jnp.asarray(rng.uniform(0.5, 2.0, c), leaf.dtype)
        if "bn" in name and name.endswith("scale"):
            return jnp.asarray(1 + 0.2 * rng.randn(c), leaf.dtype)
        if "bn" in name and name.endswith("bias"):
            return jnp.asarray(0.1 * rng.randn(c), leaf.dtype)
        return leaf
    return jax.tree_util.tree_map_with_path(visit, tree)


def _linen(conv_bias=False):
    model = ConvBn(conv_bias=conv_bias)
    variables = _realistic(flax.core.unfreeze(model.init(jax.random.PRNGKey(0), X[:1])), np.random.RandomState(1))
    return model, variables


def _nnx():
    model = NnxConvBn(nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, _realistic(state, np.random.RandomState(2))), None


MODELS = {"linen": lambda: _linen(), "linen_conv_bias": lambda: _linen(True), "nnx": _nnx}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batchnorm_joins_the_op_before_it(name):
    model, variables = MODELS[name]()
    plan = odmlq.plan(model, INT8, X[:1], variables=variables)
    kinds = [op.kind for op in plan.graph.ops]
    assert "sub" not in kinds and "mul" not in kinds and "add" not in kinds, kinds
    folded = folded_ops(plan.graph)
    assert [op.kind for op in folded] == (["conv", "dot_general"] if name.startswith("linen") else ["conv"])
    notes = [w.note for op in folded for w in plan.ops[op.id].weights if w.role == "fold"]
    assert notes and all("folded into" in n for n in notes)
    graph = odmlq.trace(model, X, variables=variables)
    params = variables if variables is not None else model
    reference = model.apply(variables, X) if variables is not None else model(X)
    np.testing.assert_array_equal(np.asarray(graph.evaluate(params, X)), np.asarray(reference))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_folded_model_computes_the_float_model(name):
    model, variables = MODELS[name]()
    graph = odmlq.trace(model, X, variables=variables)
    params = variables if variables is not None else model
    folded = fold_params(graph, params)

    def on_op(op_id, compute, *operands):
        op = graph.op(op_id)
        if op.attributes.get("fold"):
            operands = folded_operands(op, operands, folded_bias(op, operands))
        return compute(*operands)

    reference = model.apply(variables, X) if variables is not None else model(X)
    np.testing.assert_allclose(np.asarray(graph.evaluate(folded, X, on_op=on_op)), np.asarray(reference),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rules", [
    pytest.param(INT8, id="int8"),
    pytest.param([odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")], id="int16x8"),
    pytest.param([odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)], id="dynamic"),
])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_folded_exports_are_one_kernel_per_layer_and_verify(name, rules):
    model, variables = MODELS[name]()
    result = odmlq.export_tflite(model, rules, [X[:32], X[32:]], variables=variables)
    ops = result.summary.op_histogram
    assert not {"SUB", "MUL", "ADD", "STABLEHLO_COMPOSITE"} & set(ops), ops
    assert result.summary.float_islands == () or rules[0].act_dynamic
    assert result.verification.passed
    reference = np.asarray(model.apply(variables, X[32:]) if variables is not None else model(X[32:]))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, X[32:], variables=variables))
    noise = np.sum((reference - simulated) ** 2)
    assert 10 * np.log10(np.sum(reference ** 2) / noise) >= 30.0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_xla_equals_simulate_with_folded_batchnorm(name):
    model, variables = MODELS[name]()
    params = variables if variables is not None else None
    plan = odmlq.plan(model, INT8, X[:1], variables=variables)
    calibration = odmlq.calibrate(model, plan, [X], variables=variables)
    qmodel = odmlq.ptq(model, plan, params, calibration)
    y = np.asarray(qmodel(X[:7]))
    scales = odmlq.compute_scales(plan, calibration, params if params is not None else model)
    y_sim = np.asarray(odmlq.simulate(model, plan, scales, X[:7], variables=variables))
    lsb = float(np.asarray(scales.edges[plan.graph.outputs[0]].scale).reshape(-1)[0])
    assert float(np.max(np.abs(y - y_sim))) <= lsb * (1 + 1e-4)


def test_quantizing_a_folded_layer_alone_is_refused():
    model, variables = _linen()
    plan = odmlq.plan(model, INT8, X[:1], variables=variables)
    with pytest.raises(odmlq.PlanError, match=r"'conv/kernel' has a BatchNorm folded into it .*no prefix"):
        odmlq.quantize_params({"conv": variables["params"]["conv"]}, plan, prefix="")


def test_a_per_channel_gain_alone_is_folded():
    class Gain(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Conv(8, (3, 3), use_bias=False, name="conv")(x)
            return nn.Dense(4, name="head")((h * self.param("gain", nn.initializers.ones, (8,))).mean((1, 2)))

    model = Gain()
    variables = flax.core.unfreeze(model.init(jax.random.PRNGKey(0), X[:1]))
    variables["params"]["gain"] = jnp.asarray(np.linspace(0.5, 2.0, 8), jnp.float32)
    result = odmlq.export_tflite(model, INT8, [X[:32], X[32:]], variables=variables)
    assert folded_ops(result.plan.graph) and "MUL" not in result.summary.op_histogram
    assert result.verification.passed


class StandaloneBn(nn.Module):
    """BatchNorms with no matmul or convolution before them: on the input, and
    after a concatenation."""

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=True)(x)
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.BatchNorm(use_running_average=True)(jnp.concatenate([x, x[..., :2]], -1))
        return nn.Dense(4)(x.mean((1, 2)))


def test_a_batchnorm_with_nothing_to_fold_into_is_an_integer_multiply_add():
    """Its ``scale * rsqrt(var + eps)`` is read as an int8 constant where the
    multiply reads it (not stored as the statistics), its mean and bias as
    int8 operands: full-integer, verified, and close to float."""
    from tests.zoo.models import randomize_batchnorm_linen

    model = StandaloneBn()
    x = np.random.default_rng(0).normal(size=(24, 8, 8, 3)).astype(np.float32)
    variables = randomize_batchnorm_linen(model.init(jax.random.PRNGKey(0), x[:1]))
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    result = odmlq.export_tflite(model, rules, [(x[i:i + 8],) for i in (0, 8, 16)], variables=variables)
    assert result.verification.passed and result.summary.float_islands == ()
    assert not folded_ops(result.plan.graph) or all(
        "BatchNorm" not in o.param for op in folded_ops(result.plan.graph) for o in op.folds)
    read = [w for p in result.plan.ops.values() for w in p.weights if w.read_as is not None]
    assert {w.param.split("/")[-2] for w in read} == {"BatchNorm_0", "BatchNorm_1"}
    reference = np.asarray(model.apply(variables, x))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, x, variables=variables))
    assert 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2)) >= 30.0  # the CNN floor


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_folds_operands_are_read_from_a_trace_as_from_a_run_on_zeros(name):
    """`operand_values` only traces the model, computing the steps that read
    no input: every weight operand equals its value in a run on zeros, bit
    for bit, and it compiles fewer programs than that run compiles after it
    (none for an activation op; an activation operand is None). Batches of
    5 rows and more, one size per model: shapes no other test runs, so no
    program is compiled already."""
    model, variables = MODELS[name]()
    graph = odmlq.trace(model, X[:5 + sorted(MODELS).index(name)], variables=variables)
    params = variables if variables is not None else model
    ops = {op.id for op in folded_ops(graph)}
    assert ops
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiled.append(event) if event.endswith("backend_compile_duration") else None)
    values = operand_values(graph, params, ops)
    by_trace = len(compiled)
    found: dict = {}

    def on_op(op_id, compute, *operands):
        if op_id in ops:
            found[op_id] = [np.asarray(x) for x in operands]
        return compute(*operands)

    graph.evaluate(params, *[np.zeros(graph.edges[e].shape, graph.edges[e].dtype) for e in graph.inputs],
                   on_op=on_op)
    assert len(compiled) - by_trace > by_trace, (by_trace, len(compiled) - by_trace)
    assert set(values) == ops
    for op_id in ops:
        for operand, value, zero_run in zip(graph.op(op_id).operands, values[op_id], found[op_id]):
            if operand.role == "input":
                assert value is None
            else:
                np.testing.assert_array_equal(value, zero_run, err_msg=f"{op_id} {operand.role}")
