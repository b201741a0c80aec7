"""LiteRT's int16 lookup tables, computed as its kernels compute them, and the
int16 RSQRT ops whose table misses simulate on their calibrated inputs
(internal; used by `_prepare`).

TFLite's int16 RSQRT (also LOG) evaluates its function through a table of
513 values over the input's whole int16 range, interpolated linearly within
each of 512 intervals of 128 codes (``LUTPopulate<int16_t>`` and
``LUTLookup`` in tensorflow/lite/kernels/internal). 1/sqrt curves too fast
for that near zero: measured on the interpreter at three input ranges whose
1/sqrt the output covers, the table is within 1 LSB of the rounded function
above code 2,560, and up to 5,036 LSB off in the lowest interval. A norm over rows whose variances span more than about a decade
(a LayerNorm over raw audio features, an RMSNorm of inputs of varied
loudness) reads the table there. `numpy` here reproduces the kernel's
table bit for bit (tests/litert/test_tables.py checks every code against the
interpreter).
"""

from __future__ import annotations

import numpy as np

from odmlq.litert.spec import OP_SPEC

_F32 = np.float32
_STEPS = 512


def _round_away(x: np.ndarray) -> np.ndarray:
    """std::round of float32 values: halves away from zero (float64, exact)."""
    x = np.asarray(x, np.float64)
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _rsqrt(out_scale: float):
    def fn(v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, _F32)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = _F32(1) / np.sqrt(v)
        # TFLite's table function: a value <= 0 maps to the output's largest code.
        return np.where(v <= 0, _F32(32767) * _F32(out_scale), y).astype(_F32)

    return fn


def int16_table(fn, in_scale: float, out_scale: float) -> np.ndarray:
    """The 513 int16 table entries LiteRT computes for `fn` (float32 -> float32)
    at these scales (zero points 0)."""
    in_scale, out_scale = _F32(in_scale), _F32(out_scale)
    input_min, input_max = in_scale * _F32(-32768), in_scale * _F32(32767)
    output_min, output_max = out_scale * _F32(-32768), out_scale * _F32(32767)
    step = (input_max - input_min) / _F32(_STEPS)
    half = step / _F32(2)
    inverse = _F32(65536) / (output_max - output_min)
    i = np.arange(_STEPS, dtype=_F32)
    x = (input_min + i * step).astype(_F32)
    value = fn(x)
    midpoint = fn((x + half).astype(_F32))
    following = fn((input_min + (i + _F32(1)) * step).astype(_F32))
    sample = _round_away((value * inverse).astype(_F32))
    interpolated = _round_away(((following * inverse).astype(_F32) + sample.astype(_F32)) / 2)
    bias = _round_away((interpolated - _round_away((midpoint * inverse).astype(_F32))) / 2)
    last = _round_away((fn(np.asarray([input_max], _F32)) * inverse).astype(_F32))
    return np.clip(np.concatenate([sample - bias, last]), -32768, 32767).astype(np.int32)


def lookup(codes, table: np.ndarray) -> np.ndarray:
    """LiteRT's int16 table lookup: the entry below, plus the slope times the
    low 7 bits, rounded."""
    codes = np.asarray(codes, np.int32)
    index = 256 + (codes >> 7)
    base = table[index]
    delta = ((table[index + 1] - base) * (codes & 0x7F) + 64) >> 7
    return np.clip(base + delta, -32768, 32767)


def rsqrt_table_error(in_scale: float, out_scale: float, low: float) -> tuple[float, float]:
    """The largest difference, in output LSB, between LiteRT's int16 RSQRT and
    the rounded 1/sqrt (what simulate computes) over input codes from `low`
    (a float value) to the top of the range, and the input value where it is."""
    first = int(np.clip(np.ceil(low / in_scale), 1, 32767))
    codes = np.arange(first, 32768)
    exact = np.clip(_round_away(_rsqrt(out_scale)((codes * _F32(in_scale)).astype(_F32)) / _F32(out_scale)),
                    -32768, 32767)
    error = np.abs(lookup(codes, int16_table(_rsqrt(out_scale), in_scale, out_scale)) - exact)
    worst = int(np.argmax(error))
    return float(error[worst]), float(codes[worst] * in_scale)


def inaccurate_rsqrt_tables(plan, scales, calibration, skip=()) -> list[tuple]:
    """(op, LSB off, at value, calibrated low, high) for each int16 RSQRT whose
    table is farther from simulate than the op table's tolerance on the inputs
    calibration saw. Inputs whose 1/sqrt is past the output's range clip in
    both, so the range checked starts where the output's largest code is."""
    tolerance = OP_SPEC["rsqrt"].tolerance_lsb["int16"]
    found = []
    for op in plan.graph.ops:
        if op.kind != "rsqrt" or op.id in skip or len(op.inputs) != 1:
            continue
        edge = plan.graph.resolve(op.inputs[0])
        into, out = scales.edges.get(edge), scales.edges.get(op.outputs[0])
        if into is None or out is None or str(into.qtype) != "int16" or str(out.qtype) != "int16":
            continue
        in_scale, out_scale = float(np.max(into.scale)), float(np.max(out.scale))
        low = 1.0 / (32767.0 * out_scale) ** 2
        seen = calibration[edge][1] if calibration is not None and edge in calibration else None
        if seen is not None:
            low = max(low, float(np.min(seen.min)))
        lsb, at = rsqrt_table_error(in_scale, out_scale, low)
        if lsb > tolerance:
            high = float(np.max(seen.max)) if seen is not None else 32767.0 * in_scale
            found.append((op, lsb, at, low, high))
    return found


def rsqrt_kept_float(plan, scales, calibration, allow_float_ops: bool, float_ops) -> list[str]:
    """The int16 RSQRT ops to keep in float (`inaccurate_rsqrt_tables`), with
    `allow_float_ops`; without it, the first is refused before conversion
    (it failed verification after it, as "the converter produced a kernel
    that does not compute what the plan says")."""
    from odmlq.litert._check import FloatOpsError

    found = inaccurate_rsqrt_tables(plan, scales, calibration, skip=set(float_ops))
    if found and not allow_float_ops:
        op, lsb, at, low, high = found[0]
        where = (f"Rule({op.module_path!r}, weight_qtype='int8', act_qtype='int8') before your rules"
                 if op.module_path else "a rule for its module with act_qtype='int8'")
        raise FloatOpsError(
            f"op {op.id!r} (module {op.module_path!r}): LiteRT's int16 RSQRT reads a 513-entry table, which is "
            f"{lsb:.0f} int16 LSB from 1/sqrt at {at:.3g} (allowed {OP_SPEC['rsqrt'].tolerance_lsb['int16']:g}); "
            f"its calibrated inputs span {low:.3g} to {high:.3g}, and the table is exact only within about a "
            "decade of the top. Keep it in float with allow_float_ops=True (the export then computes it in "
            f"float between int16 tensors), or give it int8 activations ({where}).")
    return [op.id for op, *_ in found]
