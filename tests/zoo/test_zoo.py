"""Smoke tests of the model zoo (tests/zoo/models.py): models odmlq was not tuned on.

Per model: the float model runs on its batch-1 example and on a batch of 7
(finite, the batch dimension kept, each row independent of the others), and
`odmlq.plan` with int8 weights and activations either succeeds or raises an
`odmlq.OdmlqError` — which one is recorded (`record_property('plan', ...)`,
and printed with -s). Anything else escaping odmlq fails the test.

The hf_* models need transformers 4.x (the last line with Flax models); they
are skipped where it is not installed. bench/zoo.py measures the exports.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import odmlq
from odmlq.graph import GraphCache
from tests.zoo.models import NEEDS_DIFFUSERS, NEEDS_TRANSFORMERS, SLOW_ZOO, ZOO

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _zoo_model(name: str):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    if name in NEEDS_DIFFUSERS:
        pytest.importorskip("diffusers")
    return _build(name)


@functools.cache
def _build(name: str):
    return ZOO[name]()


# The default run exports every model of the fast zoo to int8, verified; the
# dynamic-range export, both XLA schemas and the edge-by-edge comparison run there
# on one model of each form (an NNX and a transformers CNN with BatchNorm, a U-Net,
# an encoder and a decoder with masks, a class token), and on the rest with -m slow.
# With all of them in the default run, on an AMD EPYC host without AVX-512, the
# zoo's 38 slowest tests took 32 minutes of one worker (an int8 export 29-130 s,
# half of it XLA compiling the ops the export runs one by one).
BREADTH = frozenset({"cnn_nnx", "hf_resnet", "unet_linen", "hf_bert", "hf_gpt2", "hf_vit"})


def _params(fast: frozenset | None = None):
    """Every zoo model; -m slow for SLOW_ZOO and, given `fast`, for the others outside it."""
    return [pytest.param(name, id=name, marks=[pytest.mark.slow]
                         if name in SLOW_ZOO or (fast is not None and name not in fast) else [])
            for name in ZOO]


@pytest.mark.parametrize("name", _params())
def test_float_model_runs(name):
    z = _zoo_model(name)
    assert z.family in FLOOR_DB
    assert all(isinstance(x, np.ndarray) and x.shape[0] == 1 for x in z.example_inputs)
    assert z.num_params < 2_000_000
    apply = jax.jit(z.apply)
    y1 = np.asarray(apply(*z.example_inputs))
    assert y1.shape[0] == 1 and np.isfinite(y1).all()
    (batch,) = z.make_batches(1, 7, 123)
    assert all(x.shape[0] == 7 for x in batch)
    y7 = np.asarray(apply(*batch))
    assert y7.shape == (7, *y1.shape[1:]) and np.isfinite(y7).all()
    # Rows do not see each other (BatchNorm in inference, masks per row).
    row = np.asarray(apply(*(x[3:4] for x in batch)))
    np.testing.assert_allclose(row, y7[3:4], rtol=1e-4, atol=1e-4 * float(np.abs(y7).max()))


def _sqnr_db(reference, value) -> float:
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / max(np.sum((reference - value) ** 2), 1e-30)))


# Output SQNR floors against float JAX on held-out inputs (the real-models issue). Audio
# (Wav2Vec2) measures 22-24 dB at int8: its first LayerNorm's norm factor, over
# features of raw audio, spans a wide range in one per-tensor int8 scale (26.7 dB there).
# Mobile (the MobileNetV3-like CNN) measures 27.1 dB at int8: its squeeze-excite gates and
# hard-swishes are each an int8 edge (36-43 dB apiece), and the classifier over 256 random
# features loses 11.6 dB against its input edge (38.5 -> 26.9 dB).
# The VAE decoder (diffusers) measures 22 dB at int8: its middle block's attention over
# 256 latent positions reads an int8 softmax (1/256 per LSB, so the mean weight is one
# LSB: 15 dB there), and eight GroupNorm residual blocks follow it.
# CLIP's vision tower ("class_token") measures 21.2 dB at int8: its output is the class
# token, whose embedding values are about 5x smaller than the patch tokens' in one
# per-tensor int8 scale, and a LayerNorm per token (pre_layrnorm) divides each token's
# rounding by its own spread. int16x8 on the embeddings and that LayerNorm: 39.0 dB.
# The ViT + BERT dual encoder ("class_token") measures 24.7 dB at int8 (simulate, 32
# held-out pairs): its image tower's pooler is a tanh of the class token, whose int8
# output grid the kernel fixes at 1/128, over the small values of a freshly initialized
# Dense; that tanh in float gives 31.5 dB (the image half: 22.5 -> 35.5 dB).
# BEiT ("mean_pooled") measures 25.2 dB at int8: its head averages the patch tokens and
# normalizes that one 64-feature vector with a LayerNorm, whose squared deviations alone
# cost 30.2 dB (a few features carry most of the variance in one per-tensor int8 scale).
# int16x8 on the pooler: 28.3 dB.
# The diffusion denoisers (diffusers' UNet and ControlNet) measure 19.6 and 23.1 dB at int8
# (LiteRT, 28 held-out samples; int16x8 35.5 and 38.9 dB). Like the VAE decoder they
# attend over latent positions through an int8 softmax among GroupNorm/SiLU blocks; their
# loss was not broken down by edge.
FLOOR_DB = {"cnn": 30.0, "transformer": 25.0, "audio": 20.0, "mobile": 25.0, "vae": 18.0, "class_token": 20.0,
            "mean_pooled": 22.0, "diffusion": 18.0}

# Models whose timestep embedding (SIN and COS of an integer input times constant
# frequencies) has no integer kernel: exported with allow_float_ops, and only those ops,
# their CAST and MUL and the QUANTIZE of their results, may be float: exact functions of
# the integer timestep (`tests/plan/test_from_integers.py`). Without the option the export
# refuses the COS by name, with the rule that keeps it float.
TIMESTEP_FLOAT = frozenset({"unet_diffusers", "controlnet_diffusers"})
TIMESTEP_OPS = frozenset({"CAST", "MUL", "SIN", "COS", "QUANTIZE", "CONCATENATION"})


@functools.cache
def _exported(name: str):
    # 64 calibration samples (the export holds the last batch of 8 back to
    # verify): with 12, MinMax ranges of 1x1 feature maps and logits, seen a
    # dozen times per channel, were far narrower than unseen data's.
    z = _zoo_model(name)
    result = odmlq.export_tflite(z.model, RULES, z.make_batches(8, 8, 0), variables=z.variables,
                                 allow_float_ops=name in TIMESTEP_FLOAT)
    return z, result


def _assert_integer_but_the_timestep(name: str, summary) -> None:
    if name not in TIMESTEP_FLOAT:
        assert summary.float_islands == (), [o.name for o in summary.float_islands]
        return
    islands = {(o.name, o.module_path) for o in summary.float_islands}
    assert {"SIN", "COS"} <= {kind for kind, _ in islands}, islands
    assert all(kind in TIMESTEP_OPS and path is not None and "time_proj" in path for kind, path in islands), islands


@pytest.mark.parametrize("name", _params())
def test_int8_export_is_full_integer_verifies_and_meets_its_floor(name):
    """The one-line int8 rule and no other option: BatchNorm folded, masks
    read as bool, embeddings at constant positions read as constants, so
    every op has an integer kernel and nothing stays float."""
    z, result = _exported(name)
    assert result.verification.passed, str(result.verification)
    _assert_integer_but_the_timestep(name, result.summary)
    (held_out,) = z.make_batches(1, 32, 99)
    reference = np.asarray(z.apply(*held_out))
    simulated = odmlq.simulate(z.model, result.plan, result.scales, *held_out, variables=z.variables)
    assert _sqnr_db(reference, simulated) >= FLOOR_DB[z.family]


@pytest.mark.parametrize("schema", ["weight_only", "w8a8"])
@pytest.mark.parametrize("name", _params(BREADTH))
def test_ptq_runs_at_batch_1_and_7_and_meets_its_floor(name, schema):
    z, result = _exported(name)
    rules = [odmlq.Rule(".*", weight_qtype="int8")] if schema == "weight_only" else result.plan
    calibration = None if schema == "weight_only" else result.calibration
    params = z.variables if z.variables is not None else None
    qmodel = odmlq.ptq(z.model, rules, params, calibration, example_inputs=z.example_inputs)
    # The same 14 held-out samples one at a time and as two batches of 7 (one
    # sample's SQNR moves by +-1.5 dB with the sample; the floor is for the set).
    held_out = z.make_batches(2, 7, 7)
    references = np.concatenate([np.asarray(z.apply(*x)) for x in held_out])
    for batch in (1, 7):
        outputs = []
        for x in held_out:
            for start in range(0, 7, batch):
                y = np.asarray(qmodel(*(v[start:start + batch] for v in x)))
                assert y.shape[0] == batch
                outputs.append(y)
        sqnr = _sqnr_db(references, np.concatenate(outputs))
        assert sqnr >= FLOOR_DB[z.family], (batch, sqnr)


@pytest.mark.parametrize("name", _params(BREADTH))
def test_compare_lines_up_xla_and_litert_edge_by_edge(name):
    """`odmlq.compare` with both backends: every edge LiteRT materialises is
    matched, and both backends' outputs agree with `simulate` (LiteRT within
    its kernels' tolerance, at most a few LSB end to end; XLA within 2 LSB)."""
    z, result = _exported(name)
    qmodel = odmlq.ptq(z.model, result.plan, z.variables, result.calibration)
    (held_out,) = z.make_batches(1, 2, 99)
    # A model whose ops depend on the batch size (DistilBERT's jnp.matmul drops
    # batch axes of size 1) is compared in batches of the plan's size, as
    # compare's error for other sizes says.
    held_out = GraphCache(z.model, result.plan, z.variables).parts(held_out)[0]
    report = odmlq.compare(z.model, result.plan, result.scales, *held_out, variables=z.variables,
                           tflite=result.tflite, xla=qmodel)
    assert {"litert", "xla"} <= set(report.runs)
    lined_up = [e for e in report.edges if "litert" in e.runs and "xla" in e.runs]
    # Of the quantized edges (integer ones, a mask's or a position's arithmetic, are
    # not compared).
    quantized = [e for e in report.edges if result.plan.edges[e.edge].spec is not None]
    assert len(lined_up) >= len(quantized) // 2, (len(lined_up), len(quantized))
    for out in report.outputs.values():
        assert out.sqnr_db >= FLOOR_DB[z.family] - 3.0  # two samples, not the floor's eight
    xla_lsb = [e.runs["xla"].simulate_lsb for e in lined_up if e.runs["xla"].simulate_lsb is not None]
    assert xla_lsb and max(xla_lsb) <= XLA_DRIFT_LSB.get(z.family, 2.0), max(xla_lsb)


# XLA and simulate round a requantization's ties their own ways: an edge may be one LSB
# apart, and each later edge sees it. A sigmoid's output moves by up to
# 0.25 x (input scale / output scale) LSB per input LSB: in the VAE decoder one
# convolution's LSB (the first difference) is 2-3 LSB at the next SiLU's sigmoid, and
# 7 LSB after eight GroupNorm/SiLU blocks (measured on its held-out latents).
XLA_DRIFT_LSB = {"vae": 8.0}


DYNAMIC_RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]


@pytest.mark.parametrize("name", _params(BREADTH))
def test_dynamic_range_export_verifies_and_meets_its_floor(name):
    """The one-line dynamic-range rule (int8 weights, inputs quantized at run
    time) and no other option: the file computes what simulate does, op by op
    (within 1e-4 of each op's largest value; the export raises otherwise), and
    no weight is dequantized or transposed at every invocation (refused too)."""
    z = _zoo_model(name)
    result = odmlq.export_tflite(z.model, DYNAMIC_RULES, z.make_batches(2, 8, 0), variables=z.variables,
                                 benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.schema == "dynamic", result.summary.schema
    (held_out,) = z.make_batches(1, 16, 99)
    reference = np.asarray(z.apply(*held_out))
    simulated = odmlq.simulate(z.model, result.plan, result.scales, *held_out, variables=z.variables)
    assert _sqnr_db(reference, simulated) >= FLOOR_DB[z.family]


INT16X8_RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]
# LayerNorms whose calibrated variances span more than a decade: one int16 RSQRT
# table was 65-4,603 LSB off there (refused, or float with allow_float_ops), and
# Wav2Vec2's, over raw audio features, 2,693 (`odmlq/litert/_tables.py`: pieces
# now). CLIP's text pooling and BigBird's blocks gather an activation's rows (no
# int16 GATHER_ND: a one-hot int16 matmul now). The rest of the zoo's int16x8
# exports: bench/zoo.py --schemas int16x8. The ViT -> GPT-2 and Wav2Vec2 -> BART
# encoder-decoders' cross-attention adds a constant bias of zeros (their masks of ones,
# folded): read at the default scale of a zero range (1), it made LiteRT abort.
INT16X8_ZOO = ("hf_vit", "hf_wav2vec2", "hf_beit", "hf_opt", "hf_clip_vision", "hf_dinov2", "hf_clip_text",
               "hf_bigbird", "hf_vision_encoder_decoder", "hf_speech_encoder_decoder")


@pytest.mark.parametrize("name", [pytest.param(n, id=n, marks=[pytest.mark.slow] if n in SLOW_ZOO else [])
                                  for n in INT16X8_ZOO])
def test_int16x8_export_is_full_integer_and_verifies(name):
    """The one-line int16x8 rule and no other option. Floor: 35 dB against
    float (measured 36.8-63.0 dB; int16 activations hold 8 more bits than the
    int8 floors' 20-30 dB assume)."""
    z = _zoo_model(name)
    result = odmlq.export_tflite(z.model, INT16X8_RULES, z.make_batches(8, 8, 0), variables=z.variables,
                                 benchmark=False, allow_float_ops=name in TIMESTEP_FLOAT)
    assert result.verification.passed, str(result.verification)
    _assert_integer_but_the_timestep(name, result.summary)
    (held_out,) = z.make_batches(1, 16, 99)
    reference = np.asarray(z.apply(*held_out))
    simulated = odmlq.simulate(z.model, result.plan, result.scales, *held_out, variables=z.variables)
    assert _sqnr_db(reference, simulated) >= 35.0
