"""LiteRT's quantization spec, in one table.

For each op kind of a plan: whether LiteRT has an integer kernel for it (in
the int8 and int16x8 schemas), what that kernel requires of its output's
scale and zero point, in the vocabulary of `odmlq.constraints`, and which
activations it fuses:

- ``SAME_AS_INPUT``: the output shares the input's scale and zero point
  (LiteRT's reshape, transpose, max pool, ... move values, never rescale).
- ``SHARED``: every input and the output have one scale and zero point, the
  output's (CONCATENATION, MAXIMUM, MINIMUM read their inputs at the output's
  scale; the converter folds each input's requantization into its producer,
  so the producer's output edge takes that scale — see `odmlq.scales`).
- a `FixedOutput`: the output range is fixed by the kernel (logistic, tanh,
  softmax compute into [0, 1] or [-1, 1] with a fixed scale).
- ``None``: free, taken from calibration.

`TARGET` gathers those constraints for `odmlq.plan(..., target="litert")`:
the plan resolves them into its edges, and nothing after planning reads
this table for scales.

References: LiteRT 8-bit quantization specification
(ai.google.dev/edge/litert/models/quantization_spec) and the int16x8
kernels' zero-point-0 requirement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from odmlq.constraints import (
    FixedOutput,
    FixedScale,
    OpConstraints,
    Rounding,
    SameAsInput,
    SharedWithInputs,
    Target,
)

__all__ = ["OP_SPEC", "OpSpec", "TARGET", "WITHOUT_KERNEL", "pool_as_depthwise", "pool_pads_with_zeros",
           "read_at_shared_scale", "requantized_from_producer", "sets_own_scale"]

SAME_AS_INPUT = SameAsInput()
SHARED = SharedWithInputs()

_SIGMOID_LIKE = FixedOutput({"int8": FixedScale(1.0 / 256.0, -128), "int16": FixedScale(1.0 / 32768.0, 0)})
_TANH_LIKE = FixedOutput({"int8": FixedScale(1.0 / 128.0, 0), "int16": FixedScale(1.0 / 32768.0, 0)})
# LiteRT's FULLY_CONNECTED, CONV_2D, DEPTHWISE_CONV_2D, BATCH_MATMUL, ADD, SUB
# and MUL apply a fused activation before requantizing their result.
_FUSES = frozenset({"relu", "relu6"})

@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What LiteRT's integer kernels for one op kind support and require.

    Attributes:
      schemas: activation qtypes with an integer kernel ('int8', 'int16').
      output: the output constraint: None, SAME_AS_INPUT, SHARED or a `FixedOutput`.
      rounding: how a SAME_AS_INPUT kernel rounds its output: half to even
        (requantizing kernels, like `odmlq.qarray`) or half away from zero
        (AVERAGE_POOL_2D divides its raw integer sum so), or a function of
        (op, output qtype) giving one.
      fuses: activation kinds the kernel applies before requantizing.
      limitation: ``limitation(op, qtype, graph)``: why the kernel cannot run
        this op of `graph` with `qtype` activations (a sentence naming what to
        do instead), or None when it can.
    """

    schemas: frozenset
    output: object = None
    rounding: object = Rounding.HALF_EVEN
    fuses: frozenset = frozenset()

    limitation: Callable[[Any, str, Any], str | None] | None = None
    # The LiteRT op(s) it becomes; why a schema it lacks is refused; what
    # `limitation` refuses, in words (for docs/OPS.md).
    becomes: str = ""
    refused: dict | None = None
    note: str = ""
    # Kernels that approximate (rather than round) their function: the most
    # LSBs of the output they may differ from simulate's exact value, by qtype;
    # and, for a kernel whose error grows with the axis it reduces, the LSBs per
    # element of its input's last axis (the larger of the two applies).
    tolerance_lsb: dict | None = None
    tolerance_lsb_per_element: dict | None = None

    @property
    def constraints(self) -> OpConstraints:
        """What this kernel requires of its output, for the plan."""
        return OpConstraints(output=self.output, rounding=self.rounding, fuses=self.fuses)


def _int16_add_operands(op, qtype: str, graph) -> str | None:
    """A constant or weight operand of an int16 ADD or SUB is stored at the
    output's shape (`int16_full_shape_operand`) if it is a scalar or of the
    output's rank; one of a lower rank is refused (activations of other
    shapes are broadcast: `_forms.added_at_one_shape`)."""
    if qtype != "int16" or len(op.outputs) != 1:
        return None
    rank = len(graph.edges[op.outputs[0]].shape)
    lower = [o for o in op.operands if o.role != "input" and 0 < len(o.shape) < rank]
    if not lower:
        return None
    return (f"litert-converter 0.5.0 takes int16 {op.kind.upper()} operands of one shape only, and this op "
            f"adds a constant of rank {len(lower[0].shape)} to a rank-{rank} tensor. Give the constant the "
            "output's rank (leading axes of size 1), use int8 activations, or keep this op in float with "
            "Rule(..., skip=True) and allow_float_ops=True")


def int16_full_shape_operand(op, qtype: str, value, shape) -> bool:
    """Whether a constant or weight operand of an int16 ADD or SUB is stored
    broadcast to the output's `shape`: litert-converter 0.5.0 takes int16 ADD
    operands of one shape only (see `_forms.added_at_one_shape`)."""
    return (qtype == "int16" and op.kind in ("add", "sub") and tuple(np.shape(value)) != tuple(shape)
            and np.ndim(value) in (0, len(shape)))


def _padded(op) -> bool:
    return any(lo or hi for lo, hi in op.attributes.get("padding", ()))


def padded_max_pool_reads_nonnegative(op, graph) -> bool:
    """Whether a padded max pool reads a ReLU's output: padding it with zeros
    then gives the same maximum as padding with -inf (every window holds at
    least one value, and every value is >= 0)."""
    if op.kind != "max_pool" or not _padded(op):
        return False
    edge = graph.edges[graph.resolve(op.inputs[0])]
    return edge.producer is not None and graph.op(edge.producer).kind in ("relu", "relu6")


def _int16_padded_max_pool(op, qtype: str, graph) -> str | None:
    if qtype != "int16" or not _padded(op):
        return None
    if padded_max_pool_reads_nonnegative(op, graph):
        return None  # lowered as PAD (zeros) + MAX_POOL_2D VALID
    return ("litert-converter 0.5.0 pads an int16 max pool with a PADV2 op, which has no int16 kernel "
            "(conversion fails); a pool after a ReLU is padded with zeros instead, this one's input "
            "may be negative. Use int8 activations for this pool, or pad the input yourself, or keep "
            "it in float with Rule(..., skip=True) and allow_float_ops=True")


def _transposed_conv(op, qtype: str, graph) -> str | None:
    if not op.attributes.get("transposed") or op.attributes.get("transposed_by_phases"):
        return None  # none, or one CONV_2D of its phases (`litert/_conv_transpose`)
    return ("a transposed convolution (input dilation, as nn.ConvTranspose and lax.conv_transpose "
            "write it) with a window stride or feature groups besides, or over more than two spatial "
            "axes: LiteRT has only TRANSPOSE_CONV for it, which litert-converter 0.5.0 fails to make "
            "or makes reading a dequantized int8 kernel at every invocation. Write it as "
            "nn.ConvTranspose and lax.conv_transpose do (the stride as input dilation, one group, "
            "1-D or 2-D), or upsample another way (jax.image.resize, then a convolution)")


# Entries of an int16 gather's one-hot matmul (`_forms.gathered_as_one_hot`), made at every invoke:
# CLIP's pooling, hundreds; a nearest resize of 64 to 96 rows, 6,144; 2,048 picks of 4,096, 8.4 M.
MAX_ONE_HOT_ENTRIES = 1 << 22


def _one_hot_entries(op, source) -> int:
    indices = next((o for o in op.operands if o is not source), None)
    picks = int(np.prod(indices.shape[:-1])) if indices is not None and len(indices.shape) else 1
    return int(np.prod([source.shape[a] for a in op.attributes["rows_at"]])) * picks  # (an upper bound)


def _int16_gather(op, qtype: str, graph) -> str | None:
    """An embedding table (a weight) gathered is int16 in mode 'fill' (nn.Embed,
    jnp.take's default), and in modes 'clip' and 'promise_in_bounds' (``table[ids]``)
    as its indices clamped, then gathered in mode 'fill' (`_forms.gathered_in_fill_mode`:
    litert-converter 0.5.0 makes no int16 GATHER_ND of those modes). An activation's
    whole rows are a one-hot int16 matmul (`_forms.gathered_as_one_hot`); no other
    gather of an activation is int16 (a nearest resize by an integer factor is copies)."""
    if qtype != "int16":
        return None
    if op.attributes.get("mode", "fill_or_drop") not in ("fill_or_drop", "clip", "promise_in_bounds"):
        what = f"in mode {op.attributes['mode']!r} (jnp.take's modes 'fill' and 'clip' convert)"
    elif (source := next((o for o in op.operands if o.role == "input" and o.dtype.startswith(("float", "bfloat"))),
                         None)) is None:
        return None  # a table's rows
    elif op.attributes.get("rows_at") is None:
        what = "of an activation other than whole rows (whole rows, ``nodes[senders]``, are a one-hot int16 matmul)"
    elif (entries := _one_hot_entries(op, source)) > MAX_ONE_HOT_ENTRIES:
        what = (f"of an activation as a one-hot int16 matmul of {entries:,} entries (positions times picks; at "
                f"most {MAX_ONE_HOT_ENTRIES:,}, computed and multiplied at every invocation)")
    else:
        return None
    return (f"litert-converter 0.5.0 takes no int16 GATHER_ND {what}: 'tfl.gather_nd' op operand #0 "
            "must be ... 8-bit signless integer. Use int8 activations for this op, or keep it in float "
            "with Rule(..., skip=True) and allow_float_ops=True")


def _int16_weight_slice(op, qtype: str, graph) -> str | None:
    """A run-time window of an int8 weight (a position embedding's row) written as int16:
    litert-converter 0.5.0 requantizes the whole table to the row's scale at every
    invocation (a QUANTIZE of the weight); an int16 window of an activation converts."""
    if qtype != "int16" or not any(o.role == "weight" for o in op.operands):
        return None
    return ("litert-converter 0.5.0 slices an int8 weight into an int16 tensor by requantizing the "
            "whole weight at every invocation (a run-time QUANTIZE). Give this module int8 "
            "activations with a rule of its own before the int16 one, or keep it in float with "
            "Rule(..., skip=True) and allow_float_ops=True")


def _copying_broadcast(op, qtype: str, graph) -> str | None:
    """A broadcast that only adds axes of size 1 is a RESHAPE; one that copies
    values is a BROADCAST_TO, which litert-converter 0.5.0 keeps in float."""
    out = graph.edges[op.outputs[0]].shape if len(op.outputs) == 1 else None
    if out is None or int(np.prod(out)) <= int(np.prod(op.operands[0].shape)):
        return None
    return ("a broadcast that copies an activation (BROADCAST_TO, jnp.broadcast_to or jnp.tile): "
            "litert-converter 0.5.0 keeps it in float. Let the op that reads it broadcast instead "
            "(x + y with shapes (b, 1, n) and (b, 3, n)), or keep it in float with "
            "Rule(..., skip=True) and allow_float_ops=True")


def _rows_scattered(op, qtype: str, graph) -> str | None:
    """A scatter-add LiteRT runs is one adding whole rows along one axis (`_forms.scattered_as_sums`)."""
    if op.attributes.get("rows_along") is not None:
        return None
    return ("LiteRT's STABLEHLO_SCATTER kernel refuses litert-converter 0.5.0's ADD region, and odmlq writes as a "
            "one-hot matmul only a scatter-add of whole rows along one axis (jax.ops.segment_sum, "
            "x.at[ids].add(rows) with 1-D ids); add whole rows, or keep the op out of the exported function")


def _softmax_axis(op, qtype: str, graph) -> str | None:
    axis = op.attributes.get("axis")
    ndim = len(op.operands[0].shape)
    if axis is None or axis == ndim - 1:
        return None
    return (f"LiteRT's SOFTMAX normalizes the last axis; this softmax is over axis {axis} of a "
            f"{ndim}-d tensor, which litert-converter 0.5.0 leaves as float REDUCE_MAX, SUB, EXP, "
            "SUM and DIV ops. Move that axis last around the softmax (jnp.moveaxis), or keep it "
            "in float with Rule(..., skip=True) and allow_float_ops=True")


_BOTH = frozenset({"int8", "int16"})


def pool_as_depthwise(op, qtype: str | None) -> bool:
    """Whether an avg_pool is lowered as a DEPTHWISE_CONV_2D with constant 1/n
    weights: XNNPACK runs that (its int8 AVERAGE_POOL_2D is not delegated, so
    the model would run in several partitions). It applies to NHWC pools
    without padding or dilation; the depthwise kernel requantizes its sum
    rounding half to even, where AVERAGE_POOL_2D rounds half away from zero.
    Only for int8 outputs: an int16x8 depthwise convolution takes an int64 bias,
    which only LiteRT's reference kernel reads."""
    if qtype != "int8":
        return False
    window, strides = op.attributes.get("window"), op.attributes.get("strides")
    if window is None or len(window) != 4 or op.attributes.get("dilated"):
        return False
    return (window[0] == window[3] == 1 and strides[0] == strides[3] == 1
            and (not _padded(op) or pool_pads_with_zeros(op)))


def pool_pads_with_zeros(op) -> bool:
    """Whether a padded average pool divides every window by the full window
    size (``count_include_pad=True``, Flax's default): it is then PAD (zeros)
    and a VALID pool, exactly. (Divided by each window's count of real
    values, it is LiteRT's own SAME AVERAGE_POOL_2D.)"""
    return op.kind == "avg_pool" and _padded(op) and bool(op.attributes.get("counts_padding"))


def scalar_divisor(op) -> float | None:
    """The divisor of a ``div`` by a non-zero constant scalar (``x / 6``, an
    attention's ``q / sqrt(d)``), which LiteRT computes as a MUL by its
    reciprocal where the quotient is quantized: XNNPACK has no integer DIV,
    so each one split the graph. None for any other div."""
    if op.kind != "div" or len(op.operands) != 2 or op.operands[0].role != "input":
        return None
    divisor = op.operands[1]
    if divisor.role != "constant" or divisor.value is None or np.size(divisor.value) != 1:
        return None
    value = float(np.asarray(divisor.value).reshape(()))
    return value if value != 0.0 and np.isfinite(value) else None


_INT8 = frozenset({"int8"})

_NO_INT16 = "litert-converter 0.5.0 takes no int16 operand for 'tfl.{}' (conversion fails)"

OP_SPEC: dict[str, OpSpec] = {
    "dot_general": OpSpec(_BOTH, fuses=_FUSES, becomes="FULLY_CONNECTED, BATCH_MATMUL"),
    "einsum": OpSpec(_BOTH, fuses=_FUSES, becomes="FULLY_CONNECTED, BATCH_MATMUL"),
    "conv": OpSpec(_BOTH, fuses=_FUSES, limitation=_transposed_conv, becomes="CONV_2D, DEPTHWISE_CONV_2D",
                   note="1-D: the 2-D kernel over an axis of size 1; transposed: one CONV_2D of its "
                        "phases, interleaved (window stride 1, one group, 1-D or 2-D; others refused: "
                        "litert-converter 0.5.0's TRANSPOSE_CONV reads a dequantized kernel)"),
    # int16: litert-converter 0.5.0 takes ADD operands of one shape only; an
    # activation of another shape is broadcast by a MUL by ones (exact), a
    # constant stored broadcast (`_forms.added_at_one_shape`).
    "add": OpSpec(_BOTH, limitation=_int16_add_operands, fuses=_FUSES, becomes="ADD",
                  note="int16: an operand of another shape is broadcast first (a MUL by ones, exact)"),
    "sub": OpSpec(_BOTH, limitation=_int16_add_operands, fuses=_FUSES, becomes="SUB",
                  note="int16: an operand of another shape is broadcast first (a MUL by ones, exact)"),
    "mul": OpSpec(_BOTH, fuses=_FUSES, becomes="MUL"),
    "div": OpSpec(_BOTH, becomes="DIV, MUL", note="by a constant scalar: MUL by its reciprocal "
                  "(XNNPACK has no integer DIV)"),
    "relu": OpSpec(_BOTH, becomes="RELU (or fused)"),
    # int16: fused into the op before it only (no int16 RELU6 kernel of its own).
    "relu6": OpSpec(_INT8, becomes="RELU6 (or fused)", refused={"int16": _NO_INT16.format("relu6")},
                    note="int16: fused into a matmul, convolution, ADD, SUB or MUL before it"),
    # GELU's int8 kernel is a 256-entry table of the float function.
    # int16: no GELU kernel; written as MUL, ADD and LOGISTIC (`_forms.gelu_in_int16`),
    # within a few LSB (tanh's form, the x^3 term at a step set by the input's range).
    "gelu": OpSpec(_BOTH, becomes="GELU (int8); MUL, ADD, LOGISTIC (int16)", tolerance_lsb={"int16": 16.0},
                   note="int16: x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) from int16 kernels"),
    "max": OpSpec(_BOTH, SHARED, becomes="MAXIMUM"),
    "min": OpSpec(_BOTH, SHARED, becomes="MINIMUM"),
    "reduce_sum": OpSpec(_BOTH, becomes="SUM"),
    # jax.ops.segment_sum, x.at[ids].add(rows): STABLEHLO_SCATTER's ADD region
    # fails LiteRT's kernel at load; written as a one-hot matmul (`_forms.scattered_as_sums`).
    "scatter-add": OpSpec(_BOTH, limitation=_rows_scattered, becomes="EQUAL, CAST, FULLY_CONNECTED (BATCH_MATMUL in float)",
                          note="whole rows added along one axis, as a one-hot matrix (0 and 1 exact) times the rows"),
    # REDUCE_MAX / REDUCE_MIN pick values: the output keeps the input's scale.
    "reduce_max": OpSpec(_BOTH, SAME_AS_INPUT, becomes="REDUCE_MAX"),
    "reduce_min": OpSpec(_BOTH, SAME_AS_INPUT, becomes="REDUCE_MIN"),
    "mean": OpSpec(_BOTH, becomes="MEAN"),
    # LayerNorm, RMSNorm and L2-norm pieces (x * x, 1 / sqrt, sqrt): MUL,
    # RSQRT and SQRT. x * x and SQRT are int16 kernels too (exact).
    "square": OpSpec(_BOTH, becomes="MUL"),
    # LiteRT's int16 RSQRT is a table (`_tables`): up to 8 int16 LSB from 1/sqrt (mean ~1) on
    # BERT's LayerNorms, 20 on GPT-2's; inputs spanning more than a decade, in pieces (5).
    # Allowed: 64 int16 LSB, a quarter of one int8 step.
    "rsqrt": OpSpec(_BOTH, becomes="RSQRT", tolerance_lsb={"int16": 64.0}),
    "sqrt": OpSpec(_BOTH, becomes="SQRT"),
    # An embedding lookup: GATHER_ND picks rows of the table, so its output
    # keeps the table's scale (or its activation input's). Given any other
    # scale, litert-converter requantizes the whole table before the gather
    # at every invoke (a QUANTIZE of 11.7 M values in MiniLM: +40% latency).
    "gather": OpSpec(_BOTH, SAME_AS_INPUT, limitation=_int16_gather, becomes="GATHER_ND",
                     note="the output keeps the table's scale; int16: embedding tables (table[ids] and mode 'clip' as clamped indices and mode 'fill') and an activation's whole rows (a one-hot int16 matmul, exact)"),
    # int16: litert-converter 0.5.0 takes no int16 CONCATENATION; it is written
    # as PADs and ADDs (`_forms.concatenated_by_padded_sums`), exact at the shared scale.
    "concatenate": OpSpec(_BOTH, SHARED, becomes="CONCATENATION (int8), PAD + ADD (int16)",
                          note="int16: joined by PAD and ADD, exactly (no int16 CONCATENATION in the converter)"),
    # A cache write (lax.dynamic_update_slice): the update's values copied into
    # the operand's, so both and the output share a scale. litert-converter
    # 0.5.0 takes no int16 operand ('tfl.dynamic_update_slice' ... QI8 type).
    "dynamic_update_slice": OpSpec(_INT8, SHARED, becomes="DYNAMIC_UPDATE_SLICE",
                                   note="int8 only: no int16 DYNAMIC_UPDATE_SLICE in the converter"),
    "avg_pool": OpSpec(_BOTH, SAME_AS_INPUT, becomes="DEPTHWISE_CONV_2D (int8), AVERAGE_POOL_2D",
                       rounding=lambda op, qtype: Rounding.HALF_EVEN if pool_as_depthwise(op, qtype) else Rounding.HALF_AWAY,
                       note="a pool that counts its padding is PAD + a VALID pool"),
    # int16 TANH interpolates a table: measured up to 3 LSB from the exact value.
    "tanh": OpSpec(_BOTH, _TANH_LIKE, becomes="TANH", tolerance_lsb={"int16": 4.0}),
    # int16 LOGISTIC interpolates a table too: measured up to 2 LSB from the
    # exact value (0.34 LSB on average) after a GroupNorm in a SiLU CNN.
    "logistic": OpSpec(_BOTH, _SIGMOID_LIKE, becomes="LOGISTIC", tolerance_lsb={"int16": 2.0}),
    "sigmoid": OpSpec(_BOTH, _SIGMOID_LIKE, becomes="LOGISTIC", tolerance_lsb={"int16": 2.0}),
    # int16 SOFTMAX evaluates exp and 1/x by interpolating lookup tables, not
    # within one rounding step of the exact softmax: seen <= 125 int16 LSB on
    # MiniLM. Each exp from the table is a little off and their sum carries it
    # N times, so a row where one key dominates is off by up to about 2 LSB per
    # key (LiteRT 2.3.0, logits of spread 4, on 16 / 64 / 256 / 1024 keys: at
    # most 28 / 119 / 464 / 1812 LSB; 1.3 LSB on average at every length).
    "softmax": OpSpec(_BOTH, _SIGMOID_LIKE, limitation=_softmax_axis, tolerance_lsb={"int16": 128.0},
                      tolerance_lsb_per_element={"int16": 2.0}, becomes="SOFTMAX", note="over the last axis only"),
    "reshape": OpSpec(_BOTH, SAME_AS_INPUT, becomes="RESHAPE"),
    # The identity (a softmax's shift, written out where vmap moved its axes:
    # NNX's MultiHeadAttention).
    "stop_gradient": OpSpec(_BOTH, SAME_AS_INPUT, becomes="nothing (the identity)"),
    "squeeze": OpSpec(_BOTH, SAME_AS_INPUT, becomes="RESHAPE"),
    "transpose": OpSpec(_BOTH, SAME_AS_INPUT, becomes="TRANSPOSE"),
    "rev": OpSpec(_BOTH, SAME_AS_INPUT, becomes="REVERSE_V2", note="jnp.flip; XNNPACK does not run it"),
    "broadcast_in_dim": OpSpec(_BOTH, SAME_AS_INPUT, becomes="RESHAPE", limitation=_copying_broadcast,
                               note="one that copies an activation is traced as a CONCATENATION (up to 16 copies) or a MUL by ones"),
    "max_pool": OpSpec(_BOTH, SAME_AS_INPUT, limitation=_int16_padded_max_pool, becomes="MAX_POOL_2D",
                       note="int16 padded: only after a ReLU (PAD + a VALID pool)"),
    "slice": OpSpec(_BOTH, SAME_AS_INPUT, becomes="SLICE, STRIDED_SLICE"),
    # A window at a run-time position (``lax.dynamic_slice``: a decoder's position row):
    # SLICE with a run-time begin, clamped as XLA clamps; a weight's keeps its grid.
    "dynamic_slice": OpSpec(_BOTH, SAME_AS_INPUT, becomes="SLICE", limitation=_int16_weight_slice,
                            note="int16: of activations only (an int8 weight's is requantized at run time)"),
    "split": OpSpec(_BOTH, SAME_AS_INPUT, becomes="SLICE (one per output)"),
    # SELECT_V2 picks values: both value operands and the output share a scale.
    "select_n": OpSpec(_BOTH, SHARED, becomes="SELECT_V2"),
    # Lookup-table kernels (int8): measured to export full-integer and verify;
    # EXP, ABS and LEAKY_RELU in int16 too. int16 EXP interpolates a table:
    # measured up to 9 LSB from the exact value (inputs to 1.5x the range).
    "exp": OpSpec(_BOTH, becomes="EXP", tolerance_lsb={"int16": 16.0}),
    "log": OpSpec(_INT8, becomes="LOG", refused={"int16": _NO_INT16.format("log")}),
    # LiteRT's int8 LOG_SOFTMAX writes a fixed grid: 16/256 per step, from -16 up to 0.
    "log_softmax": OpSpec(_INT8, FixedOutput({"int8": FixedScale(16.0 / 256.0, 127)}), limitation=_softmax_axis,
                          becomes="LOG_SOFTMAX", refused={"int16": _NO_INT16.format("log_softmax")}),
    "abs": OpSpec(_BOTH, becomes="ABS"),
    "leaky_relu": OpSpec(_BOTH, becomes="LEAKY_RELU"),
    "pad": OpSpec(_BOTH, SAME_AS_INPUT, becomes="PAD"),
}

# Op kinds odmlq recognises that LiteRT runs in float only, and why (each was
# forced through export with an integer spec: it failed to convert, stayed
# float between QUANTIZE/DEQUANTIZE, or missed simulate by many LSBs).
WITHOUT_KERNEL: dict[str, str] = {
    "elu": "converted to GREATER, EXP and SUB in float"
            "; kept in float by a skip rule it is MINIMUM, EXP, SUB and ADD, all XNNPACK kernels",
    "softplus": "converted to a float chain (EXP, LOG, ...)",
    "erf": "expanded into a float polynomial",
    "sin": "SIN has no integer kernel", "cos": "COS has no integer kernel",
    "pow": "POW has no integer kernel",
    "cumsum": "CUMSUM has no integer kernel",
    "selu": "converted to GREATER, EXP, SUB and MUL in float"
            "; kept in float by a skip rule it is MINIMUM, EXP, SUB and ADD, all XNNPACK kernels",
    "celu": "converted to RELU, EXP, SUB and ADD in float"
            "; kept in float by a skip rule it is MINIMUM, EXP, SUB and ADD, all XNNPACK kernels",
    "soft_sign": "converted to ABS, ADD and DIV in float",
    "log_sigmoid": "converted to a float chain (EXP, LOG, SELECT, ...)",
    "mish": "converted to a float chain (EXP, LOG, TANH, MUL, ...)",
    "squareplus": "converted to MUL, ADD and SQRT in float",
    "sparse_plus": "its comparisons stay float",
    "argmax": "ARG_MAX runs on dequantized values", "argmin": "ARG_MIN runs on dequantized values",
    "gt": "comparisons run on dequantized values", "ge": "comparisons run on dequantized values",
    "lt": "comparisons run on dequantized values", "le": "comparisons run on dequantized values",
    "eq": "comparisons run on dequantized values", "ne": "comparisons run on dequantized values",
}


# LiteRT tensors have one quantized dimension: a weight whose output channels
# span two axes (Flax's DenseGeneral (embed, heads, head_dim)) gets per-tensor
# scales by default.
TARGET = Target(name="litert", ops={kind: spec.constraints for kind, spec in OP_SPEC.items()},
                weight_channel_axes=1, dynamic_inputs_need_weight=True,
                block_scale_dtype="bfloat16", dynamic_depthwise_float=True, dynamic_inputs_per_row=True,
                float_input_carrier="int16", float_kinds=frozenset(WITHOUT_KERNEL))


def requantized_from_producer(plan, c) -> bool:
    """Whether conversion `c` (`Plan.conversions`) requantizes a quantized edge
    whose producer has a scale of its own: litert-converter 0.5.0 folds such a
    QUANTIZE into the producer, which then reads one qtype and writes the other
    (seen with FULLY_CONNECTED: its int8 output silently rescaled, 0 dB; GELU:
    'input and output must have same element type'; the depthwise pool:
    'output->type != data_type (INT16 != INT8)'). The LiteRT lowering puts a
    same-scale MAXIMUM between them, which the converter does not fold through
    (`_annotate.Annotation.converted_input`)."""
    return c.source != "float" and sets_own_scale(plan, c.edge, c.source)


def read_at_shared_scale(plan, scales) -> dict[str, tuple]:
    """``{op id: ((input index, its scale, the op's output scale), ...)}``: the
    quantized inputs that an op whose kernel reads every input at its output's
    scale (`SHARED`: a concatenation, MAXIMUM, SELECT_V2...) receives on
    another grid of its qtype. `scales` gives the shared scale to the
    producers that can requantize; the others (a flip or a ReLU of an edge
    another op reads too) keep their own, and the LiteRT lowering writes their
    requantization out after a same-scale MAXIMUM. Left to litert-converter
    0.5.0, it is folded into the op producing the input: a REVERSE_V2, RESHAPE
    or SLICE then writes its input's codes under the new scale (a flip before
    a concatenation: 135 LSB off), and a RELU a scale not the plan's."""
    from odmlq.plan import input_conversion_scales

    converted = {op_id: {index for index, _ in reads} for op_id, reads in
                 input_conversion_scales(plan, scales).items()}
    out = {}
    for op in plan.graph.ops:
        target = scales.edges.get(op.outputs[0]) if len(op.outputs) == 1 else None
        if target is None or target.scale_axes or not isinstance(plan.edges[op.outputs[0]].constraint,
                                                                   SharedWithInputs):
            continue
        indices = []
        for index, operand in enumerate(op.operands):
            source = scales.edges.get(plan.graph.resolve(operand.edge)) if operand.role == "input" else None
            if (source is not None and not source.scale_axes and source.qtype == target.qtype
                    and index not in converted.get(op.id, ()) and not source.same_grid(target)):
                indices.append((index, source, target))
        if indices:
            out[op.id] = tuple(indices)
    return out


# Op kinds that move values only; the converter may remove them (`sets_own_scale`).
_LAYOUT_KINDS = frozenset({"reshape", "transpose", "squeeze", "expand_dims"})


def sets_own_scale(plan, edge_id: str, qtype: str) -> bool:
    """Whether the op producing `edge_id` (quantized as `qtype`) writes it at
    a scale of its own, not its input's: a conversion of that edge to another
    integer qtype is read after a separator (`requantized_from_producer`)."""
    producer = plan.graph.edges[edge_id].producer
    edge = plan.edges.get(edge_id)
    if producer is None or edge is None:
        return False
    kind = plan.graph.op(producer).kind
    inputs = plan.graph.op(producer).inputs
    if kind in _LAYOUT_KINDS and isinstance(edge.constraint, SameAsInput) and len(inputs) == 1:
        # The converter drops a reshape or a unit-axis transpose and folds the
        # conversion into the op before it (diffusers' one-head VAE attention:
        # FULLY_CONNECTED int8 -> int16, its scale not the plan's).
        source = plan.edges.get(inputs[0])
        return source is not None and source.spec is not None and sets_own_scale(plan, inputs[0], qtype)
    # An average pool lowered as a depthwise convolution requantizes too, and so
    # does an int16 concatenation's last ADD (`_forms.concatenated_by_padded_sums`:
    # an int16 ADD folded the int8 conversion after it, -1.4 dB at the outputs).
    return edge.constraint is None or (
        kind == "avg_pool" and pool_as_depthwise(plan.graph.op(producer), qtype)) or (
        kind == "concatenate" and qtype == "int16" and len(inputs) > 1)
