"""Straight-through fake quantization and scales traced from the weights
(internal; `odmlq.training.QAT` uses them).

A rounded value's gradient is the identity's (the straight-through
estimator), zero where the value was clipped to its grid's ends. The value
itself is exactly what `odmlq.simulate` computes: the same `TensorScale`
fake-quantizes it, so a trained model exports with the same numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from odmlq.calibration import AbsMax
from odmlq.errors import RuleError
from odmlq.hooks import FakeQuant, dynamic_fake_quant
from odmlq.qarray import compute_scale, scale_shape
from odmlq.scales import TensorScale, fake_quant_bias

__all__ = ["Straight", "passed", "straight", "traced_weight_scale"]


@jax.custom_jvp
def _passed(x, value, lo, hi):
    del x, lo, hi
    return value


@_passed.defjvp
def _passed_jvp(primals, tangents):
    x, value, lo, hi = primals
    dx = tangents[0]
    return value, jnp.where((x >= lo) & (x <= hi), dx, jnp.zeros_like(dx))


def passed(x: jax.Array, value: jax.Array, lo=-jnp.inf, hi=jnp.inf) -> jax.Array:
    """`value` (computed from `x`), with the gradient of `x` passed through
    where ``lo <= x <= hi`` and zero elsewhere."""
    return _passed(x, jax.lax.stop_gradient(value).astype(x.dtype), jnp.asarray(lo, x.dtype),
                   jnp.asarray(hi, x.dtype))


def straight(x: jax.Array, ts: TensorScale) -> jax.Array:
    """`ts.fake_quant(x)`, its gradient passed straight through inside the grid."""
    value = ts.fake_quant(jax.lax.stop_gradient(x))
    qmin, qmax = ts.qtype.range(ts.narrow_range)
    zero = 0.0 if ts.zero_point is None else jnp.asarray(ts.zero_point, jnp.float32)
    scale = jnp.asarray(ts.scale, jnp.float32)
    if ts.block_axis is not None:
        return passed(x, value)
    return passed(x, value, (qmin - zero) * scale, (qmax - zero) * scale)


class Straight(FakeQuant):
    """`FakeQuant` with straight-through gradients: the values of `simulate`."""

    def integer_sums(self, op) -> bool:
        # Gradients flow through the matmul of dequantized values; the exact
        # integer sums of `simulate` differ from it by float rounding only.
        return False

    def edge(self, edge_id, x, ts):
        return straight(x, ts)

    def converted_input(self, op, index, x, ts):
        return straight(x, ts)

    def dynamic_input(self, op, index, x, spec):
        return passed(x, dynamic_fake_quant(jax.lax.stop_gradient(x), spec))

    def folded_bias(self, op, bias, scale):
        return bias if scale is None else passed(bias, fake_quant_bias(jax.lax.stop_gradient(bias), scale))


def traced_weight_scale(w: jax.Array, spec, template: TensorScale) -> TensorScale:
    """The scale `compute_scales` gives weight `w` (``AbsMax`` calibration),
    computed in the traced program from the current weight; `template` is that
    weight's scale at the start (its layout)."""
    method = spec.calibration
    if not isinstance(method, AbsMax):
        raise RuleError(f"Quantization-aware training computes each weight's scale from its absolute "
                        f"maximum at every step; weight_calibration={method!r} is not supported. Use "
                        "odmlq.AbsMax() (the default), with clip_ratio to clip.")
    x = jax.lax.stop_gradient(jnp.asarray(w, jnp.float32))
    shape = scale_shape(x.shape, spec.scale_axes, spec.block_axis, spec.block_size)
    keep = set(spec.scale_axes)
    if spec.block_size is not None:
        a, b = spec.block_axis, spec.block_size
        x = x.reshape(x.shape[:a] + (x.shape[a] // b, b) + x.shape[a + 1:])
        keep = {ax if ax < a else ax + 1 for ax in keep} | {a}
    bound = jnp.max(jnp.abs(x), axis=tuple(ax for ax in range(x.ndim) if ax not in keep))
    bound = (bound * jnp.float32(method.clip_ratio)).reshape(shape)
    scale, zero_point = compute_scale(-bound, bound, spec.qtype, symmetric=spec.symmetric,
                                      narrow_range=spec.narrow_range)
    dtype = getattr(spec, "scale_dtype", "float32")
    if dtype in ("float16", "bfloat16"):
        scale = _float16_up(scale)
    if dtype == "bfloat16":
        scale = _bfloat16_up(scale)
    return TensorScale(qtype=template.qtype, scale=scale, zero_point=zero_point, scale_axes=template.scale_axes,
                       block_axis=template.block_axis, block_size=template.block_size,
                       narrow_range=template.narrow_range)


def _bfloat16_up(scale: jax.Array) -> jax.Array:
    """`odmlq.scales.bfloat16_up` (after `_float16_up`) in the traced program."""
    brain = scale.astype(jnp.bfloat16)
    brain = jnp.where(brain.astype(jnp.float32) < scale, jnp.nextafter(brain, jnp.bfloat16(jnp.inf)), brain)
    return brain.astype(jnp.float32)


def _float16_up(scale: jax.Array) -> jax.Array:
    """`odmlq.scales.float16_up` in the traced program."""
    half = scale.astype(jnp.float16)
    half = jnp.where(half.astype(jnp.float32) < scale, jnp.nextafter(half, jnp.float16(jnp.inf)), half)
    half = jnp.where((half == 0) & (scale > 0), jnp.float16(2.0 ** -24), half)
    return half.astype(jnp.float32)
