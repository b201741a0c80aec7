"""Weight-only and dynamic-range exports are verified op by op, their float tensors fed and compared."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq
from odmlq.litert.verify import FLOAT_TOLERANCE
from tests.litert import _decoder

DYNAMIC = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
INT4_BLOCKS = [odmlq.Rule("embedding.*", weight_qtype="int8", act_qtype="int8", act_dynamic=True),
               odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32), act_qtype="int8",
                          act_dynamic=True)]
WEIGHT_ONLY = [odmlq.Rule(".*", weight_qtype="int8")]


@pytest.fixture(scope="module")
def decoder():
    return _decoder.decoder()


@pytest.mark.parametrize("rules", [DYNAMIC, INT4_BLOCKS, WEIGHT_ONLY], ids=["dynamic", "int4-blocks", "weight-only"])
def test_every_float_op_of_a_decode_step_is_checked_against_simulate(decoder, rules):
    model, variables, _, steps = decoder
    result = odmlq.export_tflite(model, rules, steps, variables=variables, method="decode", progress=False,
                                 benchmark=False)
    report = result.verification
    assert report.passed
    edges = {c.edge for c in report.checks}
    # The matmuls (those whose output is a tensor of its own: query, key and value are written
    # reshaped), the norms' reductions and rsqrt, softmax and silu's sigmoid and product: each op,
    # not only the outputs.
    for layer in range(_decoder.CONFIG.layers):
        for op in ("attention/output/dot_general", "gate/dot_general", "up/dot_general", "down/dot_general",
                   "attention_norm/mean", "mlp_norm/rsqrt", "attention/softmax", "logistic", "mul",
                   "attention/einsum"):
            assert f"layer_{layer}/{op}" in edges, (layer, op)
    assert len(report.checks) >= 100 and all(c.unit == "of max" for c in report.checks)
    # Measured: 0 for the matmuls and elementwise ops, up to 1.1e-6 for XNNPACK's own
    # reductions and transcendental kernels: 1e-4 is about 100 times that.
    assert max(c.max_lsb for c in report.checks) <= FLOAT_TOLERANCE / 50
    assert "relative to the largest value of the op's output or inputs" in str(report)


def test_a_wrong_constant_in_the_file_is_named_at_its_op_though_the_outputs_pass(decoder):
    """A fault that end-to-end checks miss: one cosine of the rotary table the
    .tflite holds made 1% larger (the row the decode step's position reads).
    The outputs stay within the 30 dB they are held to; the op check names the
    gather that reads the table."""
    model, variables, _, steps = decoder
    result = odmlq.export_tflite(model, DYNAMIC, steps, variables=variables, method="decode", progress=False,
                                 benchmark=False)
    config = _decoder.CONFIG
    half = config.head_dim // 2
    angles = np.arange(config.cache_length)[:, None] * config.rope_base ** (-np.arange(half) / half)
    table = np.cos(angles).astype(np.float32)
    position = int(steps[-1][1][0])
    changed = table.copy()
    changed[position, 1] *= 1.01
    assert result.tflite.count(table.tobytes()) >= 1
    tflite = result.tflite.replace(table.tobytes(), changed.tobytes())
    report = odmlq.litert.verify(tflite, model, result.plan, result.scales, [steps[-1]], variables=variables,
                                 min_output_sqnr_db=30.0, raise_on_failure=False)
    assert report.end_to_end_ok and report.output_sqnr_db >= 30.0, report.output_sqnr_db
    bad = [c for c in report.checks if not c.ok]
    assert bad and all(c.module_path.endswith("attention") for c in bad), [(c.edge, c.max_lsb) for c in bad]
    assert {c.edge.rpartition("/")[2] for c in bad} & {"gather", "gather_2"}, [c.edge for c in bad]
    with pytest.raises(odmlq.litert.VerificationError,
                       match=r"module 'layer_\d/attention'.*differs from simulate by up to .* of the largest value of its output"):
        odmlq.litert.verify(tflite, model, result.plan, result.scales, [steps[-1]], variables=variables)


def test_a_fused_tensor_name_is_read_as_its_own_ops():
    """transformers' Flax XGLM looks up its tokens (an int8 table) and its
    sinusoidal positions with the same bounds check; the converter named the
    positions' select for both lookups (``.../embed_tokens/gather/...;.../weights/...``).
    Mapped to the token lookup, that tensor was fed to the embedding scale's MUL,
    which then read 1.1 of its largest value off: the export refused itself."""
    pytest.importorskip("transformers")
    from transformers import FlaxXGLMForCausalLM, XGLMConfig

    from tests.zoo.models import ZOO  # imports tests.zoo.hf_models once its helpers exist
    from tests.zoo.hf_models import _hf_causal_lm

    assert "hf_distilbert" in ZOO

    z = _hf_causal_lm("hf_xglm", FlaxXGLMForCausalLM, XGLMConfig(
        vocab_size=1000, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=64))
    result = odmlq.export_tflite(z.model, DYNAMIC, z.make_batches(4, 4, 0), variables=z.variables,
                                 progress=False, benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert "inner/model/mul" in {c.edge for c in result.verification.checks}


class _MaskedPool(nn.Module):
    """Flax's sst2 example's attention pooling: scores of the valid positions, `-inf` elsewhere."""

    @nn.compact
    def __call__(self, x, lengths):
        scores = nn.Dense(1, use_bias=False, name="energy")(nn.tanh(nn.Dense(16, name="keys")(x))).squeeze(-1)
        mask = jnp.arange(x.shape[1])[None] < lengths[:, None]
        weights = nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return nn.Dense(3, name="head")(jnp.einsum("bt,btd->bd", weights, x))


def test_an_edge_holding_infinities_is_compared_where_they_are_and_where_they_are_not():
    """A `-inf` mask made every difference of its op and of the op reading it relative to
    infinity (zero), and a wrong value where simulate has -inf a NaN, which passed any
    tolerance. Here the file's mask fill (the converter writes -inf as float32's lowest value)
    is replaced by -8: the outputs still pass their 30 dB, the select is named."""
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(1, 8, 12)).astype(np.float32), rng.integers(2, 8, size=(1,)).astype(np.int32))
               for _ in range(8)]
    model = _MaskedPool()
    variables = model.init(jax.random.key(0), *batches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's 'invalid value' of inf - inf
        result = odmlq.export_tflite(model, DYNAMIC, batches, variables=variables, progress=False,
                                     benchmark=False)
    checks = {c.edge: c for c in result.verification.checks}
    assert checks["select_n"].max_lsb == 0.0 and checks["softmax"].max_lsb <= FLOAT_TOLERANCE / 50, str(
        result.verification)
    lowest = np.float32(np.finfo(np.float32).min).tobytes()
    assert result.tflite.count(lowest) == 1
    tflite = result.tflite.replace(lowest, np.float32(-8.0).tobytes())
    report = odmlq.litert.verify(tflite, model, result.plan, result.scales, batches[:2], variables=variables,
                                 min_output_sqnr_db=30.0, raise_on_failure=False)
    assert report.end_to_end_ok, report.output_sqnr_db
    assert [c.edge for c in report.checks if not c.ok] == ["select_n"], str(report)
