import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odmlq import TraceError, trace
from samples.models import SAMPLES


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_graph_evaluates_exactly_like_the_model(name):
    model, inputs, variables = SAMPLES[name]()
    x = jax.random.normal(jax.random.key(1), (3, *inputs[0].shape[1:]))
    graph = trace(model, x, variables=variables)
    params = variables if variables is not None else model
    expected = model.apply(variables, x) if variables is not None else model(x)
    # Same primitives in the same order: bit-exact.
    np.testing.assert_array_equal(graph.evaluate(params, x), expected)


def test_hook_sees_every_edge_and_runs_under_jit():
    model, (x,), variables = SAMPLES["cnn"]()
    graph = trace(model, x, variables=variables)
    seen = []

    def on_edge(edge_id, value):
        seen.append(edge_id)
        return value * 2.0 if edge_id == "head/dot_general" else value

    y = jax.jit(lambda v, x: graph.evaluate(v, x, on_edge=on_edge))(variables, x)
    assert seen == list(graph.edges)  # inputs first, then op outputs in order
    np.testing.assert_allclose(y, 2.0 * model.apply(variables, x), rtol=1e-6)


def test_ops_are_layers_not_primitives():
    model, (x,), variables = SAMPLES["cnn"]()
    graph = trace(model, x, variables=variables)
    kinds = {op.id: op.kind for op in graph.ops}
    assert kinds["conv1/conv"] == "conv"
    assert kinds["conv1/relu"] == "relu"  # a named call is one op, not max(x, 0)
    assert kinds["conv1/avg_pool"] == "avg_pool"  # window sum / window size is one op
    conv = graph.op("conv1/conv")
    # The bias add is fused: one output edge for conv + bias.
    assert [o.role for o in conv.operands] == ["input", "weight", "bias"]
    assert conv.weights[0].param == "conv1/kernel"
    assert conv.weights[0].channel_axes == (3,)  # HWIO: O is axis 3
    assert conv.weights[0].contraction_axes == (2,)
    dense = graph.op("dense1/dot_general")
    assert dense.weights[0].channel_axes == (1,) and dense.weights[0].contraction_axes == (0,)
    assert graph.inputs == ("input_0",) and graph.outputs == ("head/dot_general",)
    assert graph.edges["input_0"].consumers == ("conv1/conv",)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return nn.gelu(nn.Dense(8, name="fc")(carry)), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack(name="layers")(x, None)
        return jnp.einsum("bd,dk->bk", x, self.param("proj", nn.initializers.normal(), (8, 4)))


def test_scan_stacked_layers_and_einsum():
    model, x = _Scanned(), jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    graph = trace(model, x, variables=variables)
    scan = next(op for op in graph.ops if op.kind == "scan")
    assert scan.id == "layers/scan"
    body = [op for op in graph.ops if op.region == scan.id]
    fc = next(op for op in body if op.kind == "dot_general")
    kernel = fc.weights[0]
    assert kernel.param == "layers/fc/kernel" and kernel.shape == (8, 8)
    assert kernel.stacked_axes == (0,)       # the stacked parameter is (3, 8, 8)
    assert kernel.channel_axes == (2,)       # in the parameter's layout
    assert kernel.contraction_axes == (1,)
    einsum = graph.ops[-1]
    assert einsum.kind == "einsum" and einsum.attributes["einsum"] == "bd,dk->bk"
    assert einsum.weights[0].param == "proj" and einsum.weights[0].channel_axes == (1,)
    np.testing.assert_allclose(graph.evaluate(variables, x), model.apply(variables, x), rtol=1e-6)


def test_trace_failure_names_the_model_and_input_shapes():
    model, _, variables = SAMPLES["cnn"]()
    with pytest.raises(TraceError, match=r"Tracing LinenCNN failed with example inputs of shapes \[\(1, 5\) float32\]"):
        trace(model, jnp.zeros((1, 5)), variables=variables)


def test_variables_among_the_example_inputs_are_named():
    """odmlq.plan(model, rules, variables, x): the model's own init then failed
    with a bare TypeError (too many positional arguments)."""
    model, (x,), variables = SAMPLES["cnn"]()
    with pytest.raises(TraceError, match=r"LinenCNN.init on the 2 example input\(s\) failed .*variables dict: "
                                         r"pass it as variables="):
        trace(model, variables, x)
    with pytest.raises(TraceError, match=r"LinenCNN.init on the 1 example input\(s\) failed .*pass the trained "
                                         r"variables as variables="):
        trace(model, jnp.zeros((1, 5)))


def test_plain_function_needs_params():
    with pytest.raises(TraceError, match="pass its params as variables"):
        trace(lambda p, x: x @ p["w"], jnp.ones((1, 2)))


def test_plain_function():
    params = {"w": jnp.ones((2, 3))}
    graph = trace(lambda p, x: jax.nn.relu(x @ p["w"]), jnp.ones((1, 2)), variables=params)
    assert [op.kind for op in graph.ops] == ["dot_general", "relu"]
    assert graph.ops[0].weights[0].param == "w"


class _Activations(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="fc")(x)
        exact_gelu = nn.gelu(x, approximate=False)  # custom_jvp around erf
        return exact_gelu + jax.nn.silu(x) + jax.checkpoint(jnp.tanh)(x)


def test_custom_jvp_jit_and_remat_are_inlined_exactly():
    model, x = _Activations(), jax.random.normal(jax.random.key(0), (2, 4))
    variables = model.init(jax.random.key(1), x)
    graph = trace(model, x, variables=variables)
    kinds = [op.kind for op in graph.ops]
    assert "gelu" in kinds and "tanh" in kinds  # the exact gelu's steps: one op
    # silu's call is inlined: its sigmoid and product, each with a kernel of its own.
    assert "silu" not in kinds and "logistic" in kinds and kinds.count("mul") == 1
    assert graph.op("fc/gelu").attributes == {"approximate": False}
    assert not {"custom_jvp_call", "jit", "remat2", "checkpoint"} & set(kinds)
    np.testing.assert_array_equal(graph.evaluate(variables, x), model.apply(variables, x))


def _written_out_gelu(x):
    # jax.nn.gelu's tanh form, step for step.
    return x * (0.5 * (1.0 + jnp.tanh(np.sqrt(2 / np.pi).astype(np.float32) * (x + 0.044715 * x**3))))


class _Fusable(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="fc")(x)
        outs = [
            jax.nn.gelu(h, approximate=True), jax.nn.gelu(h, approximate=False), jax.nn.softmax(h),
            _written_out_gelu(h),
            jnp.broadcast_to(jnp.mean(h, axis=-1, keepdims=True), h.shape),
            jax.nn.softmax(h.reshape(-1, 2, 4), axis=1).reshape(h.shape),
        ]
        return sum(outs[1:], outs[0])


@pytest.mark.parametrize("fn", [jax.nn.hard_swish, lambda h: h * jax.nn.relu6(h + 3.0) / 6.0],
                         ids=["jax_nn", "written_out"])
def test_hard_swish_is_its_add_relu6_div_and_mul(fn):
    """Not one op: LiteRT's HARD_SWISH runs outside XNNPACK (and has no int16 kernel),
    where its four pieces are integer kernels it runs. The same values, bit for bit."""
    class _HardSwish(nn.Module):
        @nn.compact
        def __call__(self, x):
            return fn(nn.Dense(8, name="fc")(x))

    model, x = _HardSwish(), jax.random.normal(jax.random.key(0), (3, 5))
    variables = model.init(jax.random.key(1), x)
    graph = trace(model, x, variables=variables)
    # jax.nn.hard_swish divides before the MUL by x, the written-out form after it.
    assert sorted(op.kind for op in graph.ops) == ["add", "div", "dot_general", "mul", "relu6"]
    np.testing.assert_array_equal(graph.evaluate(variables, x), model.apply(variables, x))


def test_jax_nn_functions_traced_as_several_primitives_are_one_op_each():
    model, x = _Fusable(), jax.random.normal(jax.random.key(0), (3, 5))
    variables = model.init(jax.random.key(1), x)
    graph = trace(model, x, variables=variables)
    fused = [(op.kind, op.attributes) for op in graph.ops if op.kind in ("gelu", "softmax", "mean")]
    assert fused == [("gelu", {"approximate": True}), ("gelu", {"approximate": False}),
                     ("softmax", {"axis": 1}), ("gelu", {"approximate": True}), ("mean", {}),
                     ("softmax", {"axis": 1})]
    assert not {"integer_pow", "tanh", "exp", "reduce_max", "erfc", "reduce_sum", "div"} & {
        op.kind for op in graph.ops}
    gelu = graph.op("fc/gelu")
    assert [o.role for o in gelu.operands] == ["input"]  # its literals are what it computes
    assert graph.edges[gelu.outputs[0]].producer == gelu.id and len(gelu.outputs) == 1
    # The same primitives in the same order: bit-exact.
    np.testing.assert_array_equal(graph.evaluate(variables, x), model.apply(variables, x))


def test_a_chain_whose_intermediate_is_used_elsewhere_is_not_fused():
    def fn(params, x):
        t = jnp.tanh(np.sqrt(2 / np.pi).astype(np.float32) * (x + 0.044715 * x**3))
        return x * (0.5 * (1.0 + t)) + t  # t is needed outside the gelu

    graph = trace(fn, jnp.ones((2, 4)), variables={})
    assert "gelu" not in [op.kind for op in graph.ops] and "tanh" in [op.kind for op in graph.ops]


def test_constant_operands_are_listed_with_their_values_and_can_be_replaced():
    scale = np.array([0.5, -1.0, 2.0, 4.0], np.float32)

    def fn(params, x):
        return jnp.clip(x * 0.3 + scale, -0.5, 0.75)

    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    graph = trace(fn, x, variables={})
    constants = {op.kind: [np.asarray(c.value).tolist() for c in op.constants] for op in graph.ops}
    assert constants["mul"] == [pytest.approx(0.3)] and constants["add"] == [[[0.5, -1.0, 2.0, 4.0]]]
    assert constants["max"] == [-0.5] and constants["min"] == [0.75]
    seen = []

    def on_constant(op_id, index, value):
        seen.append((op_id, index))
        return jnp.zeros_like(value) if op_id == "add" else value

    y = graph.evaluate({}, x, on_constant=on_constant)
    assert sorted(seen) == sorted((op.id, 0) for op in graph.ops)
    np.testing.assert_array_equal(y, jnp.clip(x * 0.3, -0.5, 0.75))
    np.testing.assert_array_equal(graph.evaluate({}, x), fn({}, x))  # no hook: exact


def test_on_op_hook_sees_every_op_and_can_replace_it():
    def fn(params, x):
        return jax.nn.softmax(jax.nn.gelu(x)) * 2.0

    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    graph = trace(fn, x, variables={})
    seen = []

    def on_op(op_id, compute, *inputs):
        seen.append(op_id)
        return [2.0 * y for y in compute(*inputs)] if op_id == "gelu" else compute(*inputs)

    y = jax.jit(lambda x: graph.evaluate({}, x, on_op=on_op))(x)
    assert seen == ["gelu", "softmax", "mul"]
    np.testing.assert_allclose(y, jax.nn.softmax(2.0 * jax.nn.gelu(x)) * 2.0, rtol=1e-6)


def test_on_op_hook_gets_the_operands_of_a_dense_layer_with_its_bias():
    """A Dense is one op (dot_general + bias add) although the bias reshape, a
    step on the weight alone, lies between its two steps: the hook gets the
    operands in `Op.operands` order and its replacement is used."""
    model = nn.Dense(3, name="fc")
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    variables = model.init(jax.random.key(0), x)
    graph = trace(model, x, variables=variables)
    (op,) = graph.ops
    shapes = []

    def on_op(op_id, compute, *operands):
        shapes.append([tuple(np.shape(v)) for v in operands])
        return [y + 1.0 for y in compute(*operands)]

    y = graph.evaluate(variables, x, on_op=on_op)
    assert [o.role for o in op.operands] == ["input", "weight", "bias"]
    assert shapes == [[o.shape for o in op.operands]]
    np.testing.assert_allclose(y, model.apply(variables, x) + 1.0, rtol=1e-6)


def test_nnx_random_state_is_not_a_parameter():
    """An NNX module holding nnx.Rngs (and a Dropout's stream) traces, plans
    and quantizes: its PRNG keys are no weights (seen: 'JAX array with
    PRNGKey dtype cannot be converted to a NumPy array', and 'key<fry>' in ptq)."""
    from flax import nnx

    import odmlq

    class WithRngs(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            return self.drop(self.lin(x))

    model = WithRngs(nnx.Rngs(0))
    model.eval()
    x = np.random.RandomState(0).rand(8, 4).astype(np.float32)
    graph = odmlq.trace(model, x)
    assert set(graph.params) == {"lin/kernel", "lin/bias"}
    np.testing.assert_array_equal(np.asarray(graph.evaluate(model, x)), np.asarray(model(x)))
    qmodel = odmlq.ptq(model, [odmlq.Rule(".*", weight_qtype="int8")], example_inputs=(x[:1],))
    assert qmodel(x).shape == (8, 3)
    result = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], [x])
    assert result.summary.float_islands == ()
