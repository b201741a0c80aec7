"""Attention written as DistilBERT writes it (transformers' FlaxDistilBertModel):
``jnp.matmul`` over (batch, heads, ...) tensors, whose traced ops depend on the
batch size (it drops batch axes of size 1), and an int32 mask cast to float and
subtracted as ``1e30 * (1 - mask)``: a positive sentinel, a CAST of integers, and
a MUL whose constant no int8 kernel can rescale. Each of these refused or failed
the one-line int8 export before."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.calibration import Masked, MinMax, calibration_method_from_dict, compute_range, observe
from odmlq.graph import GraphCache

D, T, HEADS = 16, 8, 2


class CastMaskAttention(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        b, t, d = x.shape

        def heads(y):
            return y.reshape(b, t, HEADS, d // HEADS).transpose(0, 2, 1, 3)

        q, k, v = (heads(nn.Dense(d, name=n)(x)) for n in ("q", "k", "v"))
        scores = jnp.matmul(q / np.sqrt(d // HEADS), k.transpose(0, 1, 3, 2))
        m = mask.reshape(b, 1, 1, t).astype(scores.dtype)
        scores = scores - 1e30 * (1.0 - m)
        out = jnp.matmul(nn.softmax(scores, axis=-1), v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return nn.Dense(d, name="out")(out)


def _batch(rng, n):
    mask = np.ones((n, T), np.int32)
    mask[:, T - 3:] = 0
    return rng.normal(size=(n, T, D)).astype(np.float32), mask


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    model = CastMaskAttention()
    x, mask = _batch(rng, 1)
    variables = model.init(jax.random.key(0), x, mask)
    return model, variables, [_batch(rng, 4) for _ in range(4)], _batch(rng, 6)


def _sqnr_db(reference, value):
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - value) ** 2))


def test_traces_differ_by_batch_size_and_calibrate_cuts_rows(setup):
    model, variables, batches, _ = setup
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, *_batch(np.random.default_rng(1), 1), variables=variables)
    cache = GraphCache(model, plan, variables)
    parts = cache.parts(batches[0])
    assert len(parts) == 4 and all(p[0].shape == (1, T, D) for p in parts)
    whole = odmlq.calibrate(model, plan, batches[:1], variables=variables, progress=False)
    rows = odmlq.calibrate(model, plan, [tuple(x[i:i + 1] for x in batches[0]) for i in range(4)],
                           variables=variables, progress=False)
    for edge in ("q/dot_general", "q/sub", "out/dot_general"):
        (_, a), (_, b) = whole[edge], rows[edge]
        assert np.array_equal(a.min, b.min) and np.array_equal(a.max, b.max) and a.count == b.count


def test_int8_export_verifies_full_integer(setup):
    model, variables, batches, (x, mask) = setup
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    export = odmlq.export_tflite(model, rules, batches, variables=variables, progress=False, benchmark=False)
    # The mask's CAST is where integers enter, as a model input does: no float island.
    assert "CAST" in export.summary.op_histogram
    assert export.summary.float_islands == ()
    assert export.verification.worst is not None and export.verification.worst.max_lsb <= 1.001
    runner = odmlq.litert.interpreter(export.tflite, num_threads=1)
    inputs = runner.get_input_details()
    got = []
    for i in range(len(x)):
        for detail, value in zip(inputs, (x[i:i + 1], mask[i:i + 1])):
            runner.set_tensor(detail["index"], value)
        runner.invoke()
        got.append(runner.get_tensor(runner.get_output_details()[0]["index"])[0])
    want = np.asarray(model.apply(variables, x, mask))
    # The padded keys get no weight: this int8 model is 25 dB from float in
    # simulate on these rows; with the mask ignored the float model itself is
    # 6.0 dB from them (measured).
    assert _sqnr_db(want, np.stack(got)) >= 20


def test_mask_product_constant_is_cut_to_what_saturates(setup):
    model, variables, batches, _ = setup
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    plan = odmlq.plan(model, rules, *batches[0], variables=variables)
    calibration = odmlq.calibrate(model, plan, batches, variables=variables, progress=False)
    scales = odmlq.compute_scales(plan, calibration, odmlq.graph.params_for(model, variables, "test"))
    (key,) = [k for k in scales.constants if plan.graph.op(k[0]).kind == "mul"
              and abs(float(np.max(plan.graph.op(k[0]).constants[k[1]].value))) >= 1e29]
    constant = scales.constants[key]
    mask_edge = scales.edges[plan.graph.op(key[0]).outputs[0]]
    # The positive sentinel sits at the top of its edge's range (Masked(top=True)) ...
    assert plan.edges[plan.graph.op(key[0]).outputs[0]].spec.calibration.top
    # ... and the 1e30 is held as half what saturates it from one input step: the
    # mask's 1 (and any input of two steps) still saturates, and the MUL kernel
    # rescales by 1/2 (at 2, LiteRT's int16 MUL wrapped its product: 65535 LSB).
    held = float(np.max(constant.scale)) * 127
    one_step = float(np.max(scales.edges[plan.graph.resolve(plan.graph.op(key[0]).inputs[0])].scale))
    top = float(np.max(mask_edge.scale)) * (127 - float(np.max(mask_edge.zero_point)))
    assert held * one_step == pytest.approx(top / 2, rel=0.02)
    assert held * 1.0 > top


def test_dynamic_export_keeps_activation_matmul_inputs_float(setup):
    model, variables, batches, (x, mask) = setup
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    export = odmlq.export_tflite(model, rules, batches, variables=variables, progress=False, benchmark=False)
    assert export.summary.schema == "dynamic"
    plan = export.plan
    for op in plan.graph.ops:
        if op.kind == "dot_general" and plan.ops[op.id].dynamic_inputs_float:
            assert all(plan.edges[plan.graph.resolve(e)].spec is None for e in op.inputs), op.id


def test_xla_runs_other_batch_sizes(setup):
    model, variables, batches, (x, mask) = setup
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    example = tuple(a[:1] for a in batches[0])
    plan = odmlq.plan(model, rules, *example, variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, batches, variables=variables, progress=False)
    qmodel = odmlq.ptq(model, rules, variables, calibration, example_inputs=example)
    want = np.asarray(model.apply(variables, x[:2], mask[:2]))
    got = np.concatenate([np.asarray(qmodel(x[i:i + 1], mask[i:i + 1])) for i in range(2)])
    assert _sqnr_db(want, got) >= 15  # 19.8 dB measured on the first row; 6.0 dB with the mask ignored
    # Six rows at once run as six of the plan's batch size, the same numbers.
    assert np.array_equal(np.asarray(qmodel(x, mask))[:2], got)
    scales = odmlq.compute_scales(plan, calibration, odmlq.graph.params_for(model, variables, "test"))
    simulator = odmlq.Simulator(model, plan, scales, variables=variables)
    rows = np.concatenate([np.asarray(simulator(x[i:i + 1], mask[i:i + 1])) for i in range(len(x))])
    assert np.array_equal(np.asarray(simulator(x, mask)), rows)


def test_masked_top_range_and_round_trip():
    stats = observe(Masked(MinMax(), top=True), None, np.array([0.0, 1e30, 0.0, 1e30]))
    lo, hi = compute_range(Masked(MinMax(), top=True), stats, "int8", symmetric=False)
    assert float(lo) == 0.0 and float(hi) == 64.0
    stats = observe(Masked(MinMax(), top=True), None, np.array([-1.0, 2.0, 1e30]))
    lo, hi = compute_range(Masked(MinMax(), top=True), stats, "int8", symmetric=False)
    assert float(lo) == -1.0 and float(hi) > 2.0 + 8 * np.log(2)
    method = Masked(MinMax(), top=True)
    assert calibration_method_from_dict(method.to_dict()) == method
    assert "top" not in Masked(MinMax()).to_dict()
    with pytest.raises(odmlq.CalibrationError, match="top"):
        Masked(MinMax(), top="yes")


class ConstantCausalBias(nn.Module):
    """A decoder's causal mask as BART adds it: a constant of 0 and finfo.min."""

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(D, name=n)(x) for n in ("q", "k", "v"))
        scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
        causal = jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, jnp.finfo(jnp.float32).min)
        return nn.Dense(D, name="out")(jnp.einsum("bts,bsd->btd", nn.softmax(scores + causal, -1), v))


def test_a_constant_mask_bias_is_held_at_what_saturates():
    """The ADD of finfo.min as a constant: quantized from its value, its scale
    (2.7e36) overflowed LiteRT's rescaling, and LiteRT aborted loading the file
    (the export's probe refused it). Held at what still saturates the sum, the
    file loads and verifies."""
    rng = np.random.default_rng(2)
    model = ConstantCausalBias()
    x = rng.normal(size=(8, T, D)).astype(np.float32)
    variables = model.init(jax.random.key(1), x[:1])
    export = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                                 [x[:4], x[4:]], variables=variables, progress=False, benchmark=False)
    assert export.verification.passed, str(export.verification)
    (key,) = [k for k in export.scales.constants if export.plan.graph.op(k[0]).kind == "add"]
    assert float(np.max(export.scales.constants[key].scale)) * 127 < 1e4


class LogicalAndMask(nn.Module):
    """CLIP's text attention: the int32 mask made float, then ``jnp.logical_and``
    with a causal mask (which compares the floats with zero) and back to an
    additive bias."""

    @nn.compact
    def __call__(self, x, mask):
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
        combined = jnp.logical_and(mask[:, None, None, :].astype(jnp.float32), causal).astype(jnp.int32)
        bias = jax.lax.select(combined > 0, jnp.zeros(combined.shape, jnp.float32),
                              jnp.full(combined.shape, jnp.finfo(jnp.float32).min))
        q, k = nn.Dense(D, name="q")(x), nn.Dense(D, name="k")(x)
        scores = jnp.einsum("btd,bsd->bts", q, k) + bias[:, 0]
        return nn.Dense(D, name="out")(jnp.einsum("bts,bsd->btd", nn.softmax(scores, axis=-1), x))


_INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _planned(model, seed: int):
    """(rng, the model's int8 plan at batch 1, its variables)."""
    rng = np.random.default_rng(seed)
    x, mask = _batch(rng, 1)
    variables = model.init(jax.random.key(0), x, mask)
    return rng, odmlq.plan(model, _INT8, x, mask, variables=variables), variables


def _traced_and_exported(model, plan, variables, rng):
    """The plan's graph computes the model exactly; the int8 export verifies, full integer."""
    held_out = _batch(rng, 1)  # (the plan's batch size)
    np.testing.assert_array_equal(np.asarray(plan.graph.evaluate(variables, *held_out)),
                                  np.asarray(model.apply(variables, *held_out)))
    export = odmlq.export_tflite(model, _INT8, [_batch(rng, 4) for _ in range(4)], variables=variables,
                                 progress=False, benchmark=False)
    assert export.verification.passed and export.summary.float_islands == (), str(export.verification)
    return export


def test_an_integer_mask_made_float_and_compared_with_zero_is_compared_as_integers():
    model = LogicalAndMask()
    rng, plan, variables = _planned(model, 2)
    # The comparison reads the int32 mask: nothing float (let alone quantized) is compared.
    compares = [op for op in plan.graph.ops if op.kind in ("ne", "gt", "lt")]
    assert compares and all(plan.graph.edges[plan.graph.resolve(e)].dtype == "int32"
                            for op in compares for e in op.inputs), [(op.id, op.inputs) for op in compares]
    assert not any(op.kind == "convert_element_type" and plan.graph.edges[op.outputs[0]].dtype == "float32"
                   for op in plan.graph.ops)
    _traced_and_exported(model, plan, variables, rng)


_BLOCKS = np.array([[2, 0], [1, 3], [0, 2]])  # random key blocks, drawn at trace time


class BlockSparseMask(nn.Module):
    """BigBird's block-sparse attention (transformers' FlaxBigBirdModel), its three
    forms: a band mask that is an integer einsum contracting no axis (LiteRT has
    no integer BATCH_MATMUL), ``scores += (1.0 - band) * -10000.0`` (the in-place
    add casts a weak-typed float to float: a CAST to the same type), and key
    blocks gathered to 6 axes (no 6-axis quantize marker lowers)."""

    @nn.compact
    def __call__(self, x, mask):
        b, t, d = x.shape
        q, k = nn.Dense(D, name="q")(x), nn.Dense(D, name="k")(x)
        band = jnp.einsum("bq,bk->bqk", mask, mask)
        scores = jnp.einsum("btd,bsd->bts", q, k)
        scores += (1.0 - band) * -10000.0
        blocks = jnp.take(k.reshape(b, 1, 4, 2, d), _BLOCKS, axis=2)  # (b, 1, 3, 2, 2, d)
        far = jnp.einsum("btd,bsd->bts", q, blocks.reshape(b, 12, d))
        mixed = jnp.concatenate([nn.softmax(scores, axis=-1), nn.softmax(far, axis=-1)], axis=-1)
        return nn.Dense(D, name="out")(mixed)


def test_block_sparse_attention_masks_export_full_integer():
    """Before: 'no int8 kernel for convert_element_type', then the converter
    failed on the int32 BATCH_MATMUL, then on the 6-axis gather's marker."""
    model = BlockSparseMask()
    rng, plan, variables = _planned(model, 3)
    same_type_casts = [op.id for op in plan.graph.ops if op.kind == "convert_element_type"
                       and all(plan.graph.edges[e].dtype == "float32" for e in (*op.inputs, *op.outputs))]
    assert same_type_casts == []
    integer_matmuls = [op.id for op in plan.graph.ops if op.kind == "dot_general"
                       and plan.graph.edges[op.outputs[0]].dtype == "int32"]
    assert integer_matmuls == []
    export = _traced_and_exported(model, plan, variables, rng)
    assert all(check.max_lsb <= 1.0 + 1e-3 for check in export.verification.checks), str(export.verification)


class PenaltyMask(nn.Module):
    """An additive mask of ``(1.0 - mask) * -10000.0``: the "minus infinity" of
    BERT's original code, BigBird's and code written for float16."""

    penalty: float = -10000.0

    @nn.compact
    def __call__(self, x, mask):
        q, k, v = (nn.Dense(D, name=n)(x) for n in ("q", "k", "v"))
        scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
        scores += (1.0 - mask[:, None, :]) * self.penalty
        return nn.Dense(D, name="out")(jnp.einsum("bts,bsd->btd", nn.softmax(scores, axis=-1), v))


def test_a_mask_penalty_of_minus_ten_thousand_is_calibrated_as_a_mask():
    """Before: the scores' edge was calibrated over [-10000, 10] as data, one int8
    step of 40 for scores of a few units: 4.2 dB against float. A penalty of 1e3
    or more seeds a mask where the op reads a value computed from integer inputs
    only; the edge then leaves out values of half the penalty or more (measured:
    30.8 dB; the floor is the zoo's for transformers)."""
    rng = np.random.default_rng(0)
    model = PenaltyMask()
    x, mask = _batch(rng, 1)
    variables = model.init(jax.random.key(0), x, mask)
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    export = odmlq.export_tflite(model, rules, [_batch(rng, 4) for _ in range(4)], variables=variables,
                                 progress=False, benchmark=False)
    assert export.verification.passed and export.summary.float_islands == (), str(export.verification)
    calibration = export.plan.edges["q/add"].spec.calibration
    assert isinstance(calibration, Masked) and calibration.sentinel == 5000.0, calibration
    held_out = _batch(rng, 16)
    simulated = odmlq.simulate(model, export.plan, export.scales, *held_out, variables=variables)
    assert _sqnr_db(model.apply(variables, *held_out), simulated) >= 25.0


def test_a_large_constant_on_data_alone_is_no_mask():
    """The penalty seeds a mask only beside a value computed from integer inputs:
    data scaled by 1e4 is calibrated as data."""
    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            return nn.Dense(D, name="out")(nn.Dense(D, name="a")(x) * 1e4)

    rng = np.random.default_rng(0)
    x, mask = _batch(rng, 1)
    model = Scaled()
    variables = model.init(jax.random.key(0), x, mask)
    plan = odmlq.plan(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], x, mask,
                      variables=variables)
    assert not any(isinstance(p.spec.calibration, Masked) for p in plan.edges.values() if p.spec is not None)
