"""Op coverage as data (`odmlq.litert.coverage`, docs/OPS.md): the page is the
op table's, every supported (kind, schema) exports full-integer and verifies,
and every refusal is real: forced through export, the op fails to convert,
stays float or misses simulate."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
import odmlq.litert
from odmlq.cli import main
from odmlq.litert import coverage, spec
from odmlq.litert.export import FloatOpsError
from tests.litert.test_ops import CASES, _batches, _Fn, _Int16Pieces

ROOT = Path(__file__).resolve().parents[2]


def test_docs_ops_page_is_the_op_tables(capsys):
    page = (ROOT / "docs" / "OPS.md").read_text()
    assert page == coverage.markdown(), "docs/OPS.md is stale: run `odmlq ops > docs/OPS.md`"
    assert main(["ops"]) == 0
    assert capsys.readouterr().out == page
    kinds = {row["kind"] for row in coverage.rows()}
    assert set(spec.OP_SPEC) | set(spec.WITHOUT_KERNEL) == kinds


class _DynamicWindow(nn.Module):
    """A window of an activation at a position computed at run time (``lax.dynamic_slice``, as
    Flax's decoders read their position's row): SLICE with a run-time begin."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Dense(8, name="fc")(nn.Embed(30, 8, name="embed")(ids))
        return nn.Dense(4, name="out")(jax.lax.dynamic_slice_in_dim(h, ids[0, 0] % 2, 4, axis=1))


# One model per op kind of the table: CASES of tests/litert/test_ops.py, and these.
_MORE = {
    "dynamic_slice": (_DynamicWindow(), None),
    "sum": (_Fn(lambda x: jnp.sum(x, axis=1), features=4), (3, 4)),
    "squeeze": (_Fn(lambda x: jnp.squeeze(x[:, :1], axis=1), features=4), (3, 4)),
    "slice": (_Fn(lambda x: x[:, 1:3], features=4), (3, 4)),
    "select": (_Fn(lambda x: jnp.where(np.arange(4) % 2 == 0, x, 0.5 * x), features=4), (3, 4)),
    "broadcast": (_Fn(lambda x: x[:, None, :]), (8,)),
    # A cache write: a row copied into a tensor at a position.
    "update_slice": (_Fn(lambda x: jax.lax.dynamic_update_slice(x, 0.5 * x[:, :2], (0, 3))), (8,)),
    "embedding": (_Int16Pieces(), None),  # nn.Embed: a gather in mode fill
    "stop_gradient": (_Fn(lambda x: jax.lax.stop_gradient(x) * 0.5), (8,)),  # the identity
    "log_softmax": (_Fn(jax.nn.log_softmax), (8,)),
    # Rows summed by index (an index past the end is dropped): a one-hot matmul.
    "scatter_add": (_Fn(lambda x: jnp.zeros((x.shape[0], 4), x.dtype).at[:, np.array([0, 1, 1, 3, 0, 2, 2, 5])].add(x)),
                    (8,)),
}
# Kind -> the model that exercises it (a case name of CASES or _MORE).
KIND_CASE = {
    "dot_general": "dense", "einsum": "einsum_weight", "conv": "conv_valid", "add": "add_residual",
    "sub": "sub_residual", "mul": "mul_activations", "div": "div_by_constant", "relu": "relu",
    "relu6": "relu6", "gelu": "gelu_tanh", "max": "clip", "min": "clip",
    "reduce_sum": "sum", "reduce_max": "reduce_max", "reduce_min": "reduce_min", "mean": "mean",
    "square": "square", "rsqrt": "rsqrt", "sqrt": "sqrt", "gather": "embedding",
    "concatenate": "concatenate", "avg_pool": "avg_pool", "tanh": "tanh", "logistic": "sigmoid",
    "softmax": "softmax", "reshape": "flatten", "squeeze": "squeeze", "transpose": "transpose",
    "broadcast_in_dim": "broadcast", "max_pool": "max_pool", "slice": "slice", "split": "split",
    "select_n": "select", "exp": "exp", "log": "log", "abs": "abs", "leaky_relu": "leaky_relu",
    "pad": "pad", "rev": "flip", "dynamic_update_slice": "update_slice", "stop_gradient": "stop_gradient",
    "log_softmax": "log_softmax", "dynamic_slice": "dynamic_slice", "scatter-add": "scatter_add",
    # jax 0.10 traces jax.nn.sigmoid as the logistic primitive; the entry serves a named call.
    "sigmoid": None,
}


def _model(name):
    if name in CASES:
        case = CASES[name]
        return case.model, _batches(case.shape, case.input_scale)
    model, shape = _MORE[name]
    if shape is None:  # token ids
        rng = np.random.default_rng(0)
        return model, [rng.integers(0, 30, size=(8, 5)).astype(np.int32) for _ in range(3)]
    return model, _batches(shape)


def test_every_kind_of_the_table_has_a_model_that_traces_to_it():
    assert set(KIND_CASE) == set(spec.OP_SPEC)
    for kind, name in KIND_CASE.items():
        if name is None:
            continue
        model, batches = _model(name)
        variables = model.init(jax.random.key(0), batches[0][:1])
        assert kind in {op.kind for op in odmlq.trace(model, batches[0], variables=variables).ops}, kind


def _export(name, qtype, **options):
    model, batches = _model(name)
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=qtype)]
    return odmlq.export_tflite(model, rules, batches, variables=variables, **options)


@pytest.mark.parametrize("name", sorted({KIND_CASE[k] for k, s in spec.OP_SPEC.items()
                                         if "int16" in s.schemas and KIND_CASE[k]}))
def test_every_int16_kernel_of_the_table_exports_full_integer_and_verifies(name):
    """int8 is the subject of tests/litert/test_ops.py; here every kind the
    table gives an int16 kernel, in a 16x8 model."""
    result = _export(name, "int16")
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert result.verification.passed, str(result.verification)


_REFUSED_INT16 = sorted(k for k, s in spec.OP_SPEC.items() if "int16" not in s.schemas)


@pytest.mark.parametrize("kind", _REFUSED_INT16)
def test_a_refused_int16_kernel_really_fails_when_forced(kind, monkeypatch):
    monkeypatch.setitem(spec.OP_SPEC, kind, spec.OpSpec(frozenset({"int8", "int16"}), spec.OP_SPEC[kind].output))
    with pytest.raises(odmlq.OdmlqError):
        _export(KIND_CASE[kind], "int16")


_WITHOUT = {
    "elu": nn.elu, "softplus": nn.softplus,
    "erf": jax.scipy.special.erf, "sin": jnp.sin, "cos": jnp.cos, "pow": lambda x: jnp.abs(x) ** 1.5,
    "cumsum": lambda x: jnp.cumsum(x, axis=-1), "selu": nn.selu, "celu": nn.celu,
    "soft_sign": nn.soft_sign, "log_sigmoid": nn.log_sigmoid, "mish": jax.nn.mish,
    "squareplus": jax.nn.squareplus, "sparse_plus": jax.nn.sparse_plus,
}
# Comparisons and ARG_MAX/ARG_MIN read a quantized input and write no float:
# refused by the plan check itself, and with allow_float_ops they are float ops.
_READS_QUANTIZED = {
    "argmax": (lambda x: jnp.argmax(x, axis=-1), "ARG_MAX"), "argmin": (lambda x: jnp.argmin(x, axis=-1), "ARG_MIN"),
    "gt": (lambda x: jnp.where(x > 0, x, 0.0), "GREATER"), "ge": (lambda x: jnp.where(x >= 0, x, 0.0), "GREATER_EQUAL"),
    "lt": (lambda x: jnp.where(x < 0, x, 0.0), "LESS"), "le": (lambda x: jnp.where(x <= 0, x, 0.0), "LESS_EQUAL"),
    "eq": (lambda x: jnp.where(x == 0, 1.0, x), "EQUAL"), "ne": (lambda x: jnp.where(x != 0, x, 1.0), "NOT_EQUAL"),
}


@pytest.mark.parametrize("act_qtype", ["int8", "int16"])
def test_glu_is_its_split_logistic_and_mul(act_qtype):
    """jax.nn.glu is not kept as one op (as silu is not): its halves, LOGISTIC and
    MUL are integer kernels. As one op it stayed float ('no int8 kernel')."""
    result = _export_fn(nn.glu, act_qtype)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert result.verification.passed, str(result.verification)
    histogram = dict(result.summary.op_histogram)
    assert histogram.get("LOGISTIC") == 1 and histogram.get("MUL") == 1, histogram


@pytest.mark.parametrize("act_qtype", ["int8", "int16"])
def test_hard_tanh_is_a_clip(act_qtype):
    """jax.nn.hard_tanh compares and selects (float on LiteRT: refused before);
    the graph reads it as the clip it is, MAXIMUM and MINIMUM."""
    result = _export_fn(nn.hard_tanh, act_qtype)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert result.verification.passed, str(result.verification)
    histogram = dict(result.summary.op_histogram)
    assert histogram.get("MAXIMUM") == 1 and histogram.get("MINIMUM") == 1, histogram
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)
    graph = odmlq.trace(lambda params, v: nn.hard_tanh(v), x, variables={})
    np.testing.assert_array_equal(np.asarray(graph.evaluate({}, x)), np.asarray(nn.hard_tanh(x)))


def test_log_softmax_is_an_int8_kernel_at_its_fixed_grid():
    """LiteRT's int8 LOG_SOFTMAX takes only the output grid 16/256 (zero point
    127): calibrated, its allocation failed, and the op was refused."""
    result = _export_fn(jax.nn.log_softmax, "int8")
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert result.verification.passed, str(result.verification)
    assert dict(result.summary.op_histogram).get("LOG_SOFTMAX") == 1, result.summary.op_histogram
    (edge,) = [e for e in result.scales.edges if e.endswith("log_softmax")]
    assert float(np.ravel(result.scales.edges[edge].scale)[0]) == 16.0 / 256.0


def _export_fn(fn, act_qtype):
    model, batches = _Fn(fn), _batches((8,))
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=act_qtype)]
    return odmlq.export_tflite(model, rules, batches, variables=variables, benchmark=False)


def test_every_kind_without_a_kernel_is_forced_by_a_test():
    assert set(_WITHOUT) | set(_READS_QUANTIZED) == set(spec.WITHOUT_KERNEL)


@pytest.mark.parametrize("kind", sorted(_WITHOUT))
def test_a_kind_without_a_kernel_really_fails_when_forced(kind, monkeypatch):
    model, batches = _Fn(_WITHOUT[kind]), _batches((8,))
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    with pytest.raises(FloatOpsError, match=f"no int8 kernel for '{kind}' \\("):
        odmlq.export_tflite(model, rules, batches, variables=variables)
    monkeypatch.setitem(spec.OP_SPEC, kind, spec.OpSpec(frozenset({"int8", "int16"})))
    with pytest.raises(odmlq.OdmlqError):
        odmlq.export_tflite(model, rules, batches, variables=variables)


@pytest.mark.parametrize("kind", sorted(_READS_QUANTIZED))
def test_a_comparison_of_quantized_values_is_refused_and_runs_in_float_when_allowed(kind):
    fn, litert_op = _READS_QUANTIZED[kind]
    model, batches = _Fn(fn), _batches((8,))
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, batches[0], variables=variables)
    with pytest.raises(FloatOpsError, match=f"op 'fc/{kind}' .* reads quantized"):
        odmlq.litert.check_plan(plan)
    result = odmlq.export_tflite(model, rules, batches, variables=variables, allow_float_ops=True)
    assert litert_op in {op.name for op in result.summary.float_islands}
    assert result.verification.passed
