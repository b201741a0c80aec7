"""Dynamic-range convolutions: each kernel's input quantized as XNNPACK quantizes it.

XNNPACK runs a 1x1 convolution of stride 1 (unpadded, one group) as a matrix
multiplication over pixels and quantizes each pixel with its own range; other
convolutions (a strided 1x1 one, a 3x3 one) get one range per image. Measured
on the interpreter: a 1x1 convolution's outputs equal a per-pixel quantization
to 5e-7 and miss a per-image one by 0.025 (of outputs up to 5.9). Before the
plan said so, an EfficientNet-Lite0 or RegNet dynamic-range export failed its
own op-by-op check. Here one edge is read by all three kinds.
"""

import flax.linen as nn
import jax
import numpy as np

import odmlq
from odmlq.plan import dynamic_kernel_inputs

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]


class _Mixed(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3), name="stem")(x))
        pointwise = nn.Conv(16, (1, 1), name="pointwise")(x)
        strided = nn.Conv(16, (1, 1), strides=2, name="strided")(x)
        spatial = nn.Conv(16, (3, 3), strides=2, name="spatial")(x)
        return nn.Conv(16, (1, 1), strides=2, name="head")(pointwise) + strided + spatial


def test_each_convolution_quantizes_its_input_as_xnnpack_does():
    rng = np.random.default_rng(0)
    # Uneven rows: per-pixel and per-image ranges differ a lot.
    x = (rng.normal(size=(16, 12, 12, 3)) * rng.uniform(0.1, 3, size=(1, 12, 12, 1))).astype(np.float32)
    model = _Mixed()
    variables = model.init(jax.random.key(0), x[:1])
    result = odmlq.export_tflite(model, RULES, [x[:8], x[8:]], variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    kernels = {result.plan.graph.op(op_id).module_path: dict(inputs) for op_id, inputs in
               dynamic_kernel_inputs(result.plan).items()}
    assert kernels["pointwise"][0].scale_axes == (0, 1, 2)  # a range per pixel
    assert kernels["head"][0].scale_axes == ()  # strided: per image (per tensor at batch 1)
    for name in ("strided", "spatial"):
        assert kernels[name][0].scale_axes == (), name


def test_xla_runs_the_per_pixel_convolution_in_integers_as_simulate():
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(8, 12, 12, 3)) * rng.uniform(0.1, 3, size=(1, 12, 12, 1))).astype(np.float32)
    model = _Mixed()
    variables = model.init(jax.random.key(0), x[:1])
    plan = odmlq.plan(model, RULES, x[:1], variables=variables, target="litert")
    calibration = odmlq.calibrate(model, plan, [x], variables=variables)
    qmodel = odmlq.ptq(model, plan, variables, calibration)
    assert qmodel.lowerings["pointwise/conv"].kernel.startswith("int8 x int8")
    for batch in (1, 4):
        simulated = np.asarray(odmlq.simulate(model, plan, calibration, x[:batch], variables=variables))
        # The same integers; simulate sums a convolution's dequantized values in float32
        # (Convolutions keep summing dequantized values: odmlq._sums), so float32 rounding apart.
        np.testing.assert_allclose(np.asarray(qmodel(x[:batch])), simulated, rtol=0,
                                   atol=1e-5 * np.abs(simulated).max())
