"""odmlq.awq: per-input-channel scales moved into the op before a quantized
matmul, searched on the calibration inputs; float function unchanged."""

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from odmlq.errors import RuleError


class _PreNorm(nn.Module):
    """Every pattern AWQ scales: a LayerNorm (scale and bias) and an RMSNorm
    (scale) before matmuls, a matmul -> ReLU -> matmul, and a gated MLP's
    ``silu(gate) * up`` before its down projection."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln")(x)
        h = nn.relu(nn.Dense(64, name="d0")(h))
        g = nn.silu(nn.Dense(64, name="gate", use_bias=False)(h)) * nn.Dense(64, name="up", use_bias=False)(h)
        r = nn.RMSNorm(name="rms")(nn.Dense(32, name="down")(g))
        return nn.Dense(8, name="head")(r)


class _PostNorm(nn.Module):
    """A LayerNorm whose output the residual add reads too (BERT's post-norm)."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln")(x)
        return h + nn.Dense(32, name="ffn")(h)


class _Tied(nn.Module):
    """An RMSNorm before the output projection that reads the embedding table
    the tokens were looked up in."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(64, 32, name="embedding")
        return embed.attend(nn.RMSNorm(name="norm")(embed(tokens)))


@pytest.fixture(scope="module")
def pre_norm():
    rng = np.random.default_rng(0)
    # inputs whose channels carry very different energies, as a trained model's do
    mix = rng.normal(size=(32, 32)) * np.exp(rng.normal(size=32) * 1.5)[:, None]
    x = (rng.normal(size=(1024, 32)) @ mix).astype(np.float32)
    model = _PreNorm()
    variables = model.init(jax.random.key(0), x[:1])
    variables = jax.tree_util.tree_map_with_path(  # uneven norm gains, as trained norms have
        lambda p, a: a * np.exp(rng.normal(size=a.shape)).astype(np.float32) if "scale" in jax.tree_util.keystr(p)
        else a, variables)
    return model, variables, [x[i:i + 64] for i in range(0, 512, 64)], x[512:]


def _sqnr_db(model, variables, rules, calibration, held_out, reference):
    plan = odmlq.plan(model, rules, held_out[:1], variables=variables)
    scales = odmlq.compute_scales(plan, odmlq.calibrate(model, plan, calibration, variables=variables,
                                                        progress=False), variables)
    out = np.asarray(odmlq.Simulator(model, plan, scales, variables=variables)(held_out), np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - out) ** 2))


def test_awq_keeps_the_float_function_and_lowers_the_rounding_error(pre_norm):
    """With every gain taken (min_gain_db=0), four input edges are scaled,
    each by the parameters of the op that makes it; the float model computes
    the same outputs (float32 rounding); int4 weights rounded to nearest gain
    (measured: 10.97 -> 13.91 dB; the bound, 1.5 dB, leaves room for the
    search's grid), and each edge's readers lose error on the calibration
    inputs. By default only the edges that gain 0.5 dB or more are scaled."""
    model, variables, calibration, held_out = pre_norm
    rules = [odmlq.Rule(".*", op="dot_general", weight_qtype="int4", weight_algorithm=odmlq.Nearest())]
    result = odmlq.awq(model, rules, calibration, variables=variables, min_gain_db=0.0)
    divided = {s.edge: set(s.divided) for s in result.scaled}
    assert divided == {"ln/add_1": {"ln/scale", "ln/bias"}, "d0/relu": {"d0/kernel", "d0/bias"},
                       "gate/mul_1": {"up/kernel"}, "rms/mul_1": {"rms/scale"}}, str(result)
    assert all(s.error_db < 0 and 0 < s.alpha <= 1 for s in result.scaled), str(result)
    assert {p for s in result.scaled for p in s.readers} == {"d0/kernel", "gate/kernel", "up/kernel",
                                                            "down/kernel", "head/kernel"}

    reference = np.asarray(model.apply(variables, held_out), np.float64)
    same = np.asarray(model.apply(result.variables, held_out), np.float64)
    assert np.max(np.abs(same - reference)) <= 1e-5 * np.max(np.abs(reference))
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), variables, result.variables)
    assert changed["params"]["ln"]["scale"] and not changed["params"]["head"]["bias"]

    before = _sqnr_db(model, variables, rules, calibration, held_out, reference)
    after = _sqnr_db(model, result.variables, rules, calibration, held_out, reference)
    assert after >= before + 1.5, (before, after)

    default = odmlq.awq(model, rules, calibration, variables=variables)
    assert {s.edge for s in default.scaled} == {s.edge for s in result.scaled if s.error_db <= -0.5}, str(default)
    assert all("dB only" in default.skipped[s.edge] for s in result.scaled if s.error_db > -0.5), str(default)


def test_awq_leaves_edges_it_cannot_scale_and_says_why(pre_norm):
    model, variables, calibration, held_out = pre_norm
    static = odmlq.awq(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], calibration,
                       variables=variables)
    assert not static.scaled and all("statically" in why for why in static.skipped.values()), str(static)

    post = _PostNorm()
    post_variables = post.init(jax.random.key(1), held_out[:1])
    result = odmlq.awq(post, [odmlq.Rule(".*", weight_qtype="int4")], calibration, variables=post_variables)
    assert not result.scaled and "not a matmul" in result.skipped["ln/add_1"], str(result)
    assert "not scaled" in str(result)

    tied = _Tied()
    tokens = np.random.default_rng(2).integers(0, 64, (8, 16)).astype(np.int32)
    tied_variables = tied.init(jax.random.key(2), tokens[:1])
    result = odmlq.awq(tied, [odmlq.Rule(".*", weight_qtype="int4")], [tokens], variables=tied_variables)
    assert not result.scaled and any("tied embedding" in why for why in result.skipped.values()), str(result)


def test_awq_scaled_weights_export_verified_and_run_alike_on_xla(pre_norm):
    """The scaled variables are float parameters: LiteRT's export of them
    verifies op by op (dynamic int8 inputs, int4 weights in blocks of 32),
    and XLA computes what simulate does."""
    model, variables, calibration, held_out = pre_norm
    rules = [odmlq.Rule(".*", op="dot_general", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32),
                        act_qtype="int8", act_dynamic=True)]
    result = odmlq.awq(model, rules, calibration, variables=variables)
    assert result.scaled, str(result)
    scaled = result.variables
    export = odmlq.export_tflite(model, rules, calibration, variables=scaled, benchmark=False, progress=False)
    assert export.verification.passed, str(export.verification)
    qmodel = odmlq.ptq(model, rules, scaled, example_inputs=(held_out[:8],))
    plan = odmlq.plan(model, rules, held_out[:1], variables=scaled)
    simulated = odmlq.Simulator(model, plan, odmlq.compute_scales(plan, None, scaled), variables=scaled)
    np.testing.assert_allclose(np.asarray(qmodel(held_out[:8])), np.asarray(simulated(held_out[:8])),
                               rtol=1e-5, atol=1e-5 * float(np.max(np.abs(simulated(held_out[:8])))))


def test_bad_awq_inputs_are_named(pre_norm):
    model, variables, *_ = pre_norm
    with pytest.raises(RuleError, match="min_gain_db"):
        odmlq.awq(model, [odmlq.Rule(".*", weight_qtype="int4")], [np.ones((2, 32), np.float32)],
                  variables=variables, min_gain_db=-1)
    with pytest.raises(RuleError, match="no batches"):
        odmlq.awq(model, [odmlq.Rule(".*", weight_qtype="int4")], [], variables=variables)
    from flax import nnx

    with pytest.raises(RuleError, match="NNX"):
        odmlq.awq(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), [odmlq.Rule(".*", weight_qtype="int4")],
                  [np.ones((2, 4), np.float32)])
