"""Values derived from parameters that an elementwise integer kernel reads.

BERT adds position and token-type embeddings gathered at constant positions
(``table[arange(seq)]``): a value computed from a parameter, not stored as
one. The plan reads it like a constant operand (`WeightPlan.read_as`: the
op's activation qtype, per tensor, from its own value); the export computes
it before the converter sees it, so the file holds one int8 constant and no
GATHER / SELECT on weights (a float island before).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

RNG = np.random.RandomState(0)
IDS = RNG.randint(0, 50, size=(24, 6)).astype(np.int32)
INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


class Embeddings(nn.Module):
    @nn.compact
    def __call__(self, ids):
        words = nn.Embed(50, 16, name="words")(ids)
        positions = nn.Embed(10, 16, name="positions")(jnp.arange(ids.shape[1])[None])
        types = nn.Embed(2, 16, name="types")(jnp.zeros_like(ids))
        h = nn.LayerNorm()(words + positions + types)
        return nn.Dense(4)(h)


@pytest.fixture(scope="module")
def exported():
    model = Embeddings()
    variables = model.init(jax.random.PRNGKey(0), IDS[:1])
    batches = [(IDS[i:i + 8],) for i in range(0, 24, 8)]
    return model, variables, odmlq.export_tflite(model, INT8, batches, variables=variables)


def test_the_plan_reads_gathered_embeddings_as_constant_operands(exported):
    model, variables, result = exported
    read = {w.param: w.read_as for p in result.plan.ops.values() for w in p.weights if w.read_as is not None}
    assert {p.split("/")[0] for p in read} == {"positions", "types"}
    assert all(s.qtype == "int8" and s.symmetric and s.scale_axes == () for s in read.values())
    # The tables are not stored quantized: only the derived values are read so.
    assert not any(w.spec is not None for p in result.plan.ops.values() for w in p.weights if w.param in read)
    again = odmlq.Plan.from_json(result.plan.to_json())
    assert again.ops == result.plan.ops


def test_it_exports_full_integer_with_no_gather_on_weights(exported):
    model, variables, result = exported
    assert result.verification.passed and result.summary.float_islands == ()
    kinds = [op.name for op in result.summary.ops]
    assert kinds.count("GATHER_ND") + kinds.count("GATHER") == 1  # the word lookup only
    assert "SELECT_V2" not in kinds or all(
        result.summary.tensors[op.outputs[0]].dtype == "int8" for op in result.summary.ops if op.name == "SELECT_V2")


def test_simulate_ptq_and_litert_agree_on_the_derived_operand(exported):
    """Both backends read the same quantized value: ptq (fake-quantizes it
    where the add reads it) within 1 LSB of simulate, and the float model
    within the transformers' floor (25 dB)."""
    model, variables, result = exported
    reference = np.asarray(model.apply(variables, IDS))
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.scales, IDS, variables=variables))
    quantized = np.asarray(odmlq.ptq(model, result.plan, variables, result.calibration)(IDS))
    lsb = float(np.asarray(result.scales.edges[result.plan.graph.outputs[0]].scale).max())
    assert np.abs(quantized - simulated).max() <= lsb * 1.01
    sqnr = 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2))
    assert sqnr >= 25.0, sqnr
    scales = [result.scales.derived[k] for k in result.scales.derived]
    assert len(scales) == 2 and all(np.isfinite(np.asarray(ts.scale)).all() for ts in scales)
