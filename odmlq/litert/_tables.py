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

Such an RSQRT is exported in pieces (`RsqrtPieces`): each piece reads the
input clamped to a range of 8x, requantized so that range fills its table,
and the pieces' sum, less a constant, is 1/sqrt (within a few LSB).
"""

from __future__ import annotations

import dataclasses
import math

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
        into, out = scales.input_scale(plan, op, edge), scales.edges.get(op.outputs[0])  # (a conversion's, if read so)
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


_PIECE_RATIO = 8.0  # each piece's input range: its table reads codes 4,096 and up (4 LSB off at most)
_INTERVAL = 128  # codes per table interval


@dataclasses.dataclass(frozen=True)
class RsqrtPieces:
    """An int16 RSQRT as pieces whose tables are each exact to a few LSB.

    `bounds` b_1 > ... > b_k are input values on the input's grid. Piece 0
    reads max(x, b_1) at the input's scale; piece i (1 <= i < k) reads
    max(x, b_(i+1)) requantized to b_i / 32767 (the requantization saturates
    at b_i); piece k reads min(x, b_k) requantized so: below every calibrated
    input, where the one table was too (a zero code reads the output's top).
    For x between b_(j+1) and b_j, the pieces above read their lower bounds and
    those below their upper ones, so the pieces' sum is
    1/sqrt(x) + sum_j 1/sqrt(b_j): `constant`. `tops` is each piece's output
    range (1/sqrt at the start of the table interval holding its lower bound:
    an entry past the output's top would clip, and the interval's
    interpolation with it), `lsb` the most, in the op's output LSB, any piece's
    table is off on the inputs it reads."""

    bounds: tuple[float, ...]
    tops: tuple[float, ...]
    constant: float
    lsb: float

    def piece_scales(self, in_scale: float) -> list[float]:
        """Each piece's input step (piece 0: the input's own)."""
        return [in_scale, *(b / 32767.0 for b in self.bounds)]


def rsqrt_pieces(in_scale: float, out_scale: float, low: float) -> RsqrtPieces | None:
    """The pieces (`RsqrtPieces`) of an int16 RSQRT from input step `in_scale`
    to output step `out_scale` whose calibrated inputs start at `low`; None
    where the inputs span less than 8x (one table is as exact)."""
    bounds, value = [], 32767.0 * in_scale
    # Inputs below the lowest nonzero code read code 0, 1/sqrt's top in both.
    while value > max(low, in_scale):
        code = max(1, round(value / _PIECE_RATIO / in_scale))
        value = code * in_scale
        bounds.append(value)
    if not bounds:
        return None
    scales = [in_scale, *(b / 32767.0 for b in bounds)]
    lowers = [*bounds, None]
    tops, lsb = [], 0.0
    for i, (step, lower) in enumerate(zip(scales, lowers)):
        if lower is None:  # the last piece: the op's own output range, or its bound's 1/sqrt if above
            top = max(32767.0 * out_scale, 1.0 / math.sqrt(bounds[-1]) * (1.0 + 1.0 / 32767.0))
        else:
            start = math.floor(lower / step / _INTERVAL) * _INTERVAL
            top = 1.0 / math.sqrt(max(start, 1) * step)
            error, _ = rsqrt_table_error(step, top / 32767.0, max(lower, low))
            lsb = max(lsb, error * top / (32767.0 * out_scale))
        tops.append(top)
    return RsqrtPieces(tuple(bounds), tuple(tops), float(sum(1.0 / math.sqrt(b) for b in bounds)), lsb)


def int16_rsqrt_forms(plan, scales, calibration, allow_float_ops: bool, float_ops) -> tuple[list[str], dict]:
    """How each int16 RSQRT whose one table misses simulate (`inaccurate_rsqrt_tables`)
    is exported: in pieces (op id -> `RsqrtPieces`) where they are within the op
    table's tolerance; otherwise kept in float with `allow_float_ops` (the
    ids), and without it the first is refused before conversion (it failed
    verification after it, as "the converter produced a kernel that does not
    compute what the plan says")."""
    from odmlq.litert._check import FloatOpsError

    tolerance = OP_SPEC["rsqrt"].tolerance_lsb["int16"]
    kept, pieces = [], {}
    for op, lsb, at, low, high in inaccurate_rsqrt_tables(plan, scales, calibration, skip=set(float_ops)):
        into, out = scales.input_scale(plan, op, op.inputs[0]), scales.edges[op.outputs[0]]
        split = rsqrt_pieces(float(np.max(into.scale)), float(np.max(out.scale)), low)
        # Requantizations and sums add about 2 LSB to the tables' own error.
        if split is not None and split.lsb + 2.0 <= tolerance:
            pieces[op.id] = split
            continue
        if not allow_float_ops:
            where = (f"Rule({op.module_path!r}, weight_qtype='int8', act_qtype='int8') before your rules"
                     if op.module_path else "a rule for its module with act_qtype='int8'")
            raise FloatOpsError(
                f"op {op.id!r} (module {op.module_path!r}): LiteRT's int16 RSQRT reads a 513-entry table, which is "
                f"{lsb:.0f} int16 LSB from 1/sqrt at {at:.3g} (allowed {tolerance:g}); its calibrated inputs span "
                f"{low:.3g} to {high:.3g}, and neither the table nor tables over pieces of that range are exact "
                "there (the input's int16 grid is too coarse for the pieces). Keep it in float with "
                "allow_float_ops=True (the export then computes it in float between int16 tensors), or give it "
                f"int8 activations ({where}).")
        kept.append(op.id)
    return kept, pieces
