"""How a matched rule becomes specs: weights, constant operands, activations (internal)."""

from __future__ import annotations

from odmlq.algorithms import Nearest
from odmlq.errors import GranularityError, PlanError
from odmlq.granularity import PerBlock, PerChannel, PerTensor
from odmlq.graph import MATMUL_KINDS, Edge, Op, Operand
from odmlq.plan._spec import QuantSpec
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.rules import Rule

__all__ = ["CONSTANT_OPERAND_KINDS", "act_spec", "constant_specs", "constant_operand_spec", "dynamic_input_spec",
           "weight_spec"]


# Elementwise ops whose constant operands (x * 0.5, x + c, max(x, c)) are
# tensors an integer kernel reads like a second activation: they are quantized
# with the op's activation qtype, per tensor and symmetric, the scale taken
# from their value (see `odmlq.scales`).
CONSTANT_OPERAND_KINDS = frozenset({"add", "sub", "mul", "div", "max", "min", "select_n"})


def constant_operand_spec(op: Op, rule: Rule | None) -> QuantSpec | None:
    """The spec an elementwise op with integer activations reads an operand
    that is no activation at: a constant, a value derived from parameters by
    arithmetic, or a weight of another qtype than its activations. Its
    activation qtype, per tensor, symmetric; None where the op has no integer
    elementwise kernel under `rule`."""
    if rule is None or rule.skip or rule.act_qtype is None or rule.act_dynamic:
        return None
    if op.kind in MATMUL_KINDS and rule.weight_qtype is not None:
        # A matmul with a constant matrix (jax.image.resize's interpolation
        # weights) reads it like a weight: the weight qtype, per tensor.
        qt = lookup_qtype(rule.weight_qtype)
        return QuantSpec(qtype=qt.name, symmetric=True, narrow_range=True) if qt.is_integer else None
    if op.kind not in CONSTANT_OPERAND_KINDS:
        return None
    qt = lookup_qtype(rule.act_qtype)
    return QuantSpec(qtype=qt.name, symmetric=True) if qt.is_integer else None


def constant_specs(op: Op, rule: Rule | None) -> tuple[QuantSpec | None, ...]:
    """One spec or None per float constant operand of `op` (`Op.constants`)."""
    spec = constant_operand_spec(op, rule)
    return tuple(spec if spec is not None and c.value is not None and c.dtype.startswith(("float", "bfloat"))
                 else None for c in op.constants)


def matmul_of_rows(op: Op) -> bool:
    """Whether `op` is a matmul of its input's rows by a weight matrix (LiteRT's
    FULLY_CONNECTED): a ``dot_general``, or an einsum whose weight has only
    output and contracted axes (``jnp.einsum('btd,ndh->btnh', x, w)``, as
    ``nnx.Einsum`` writes Gemma's projections); a weight axis that is neither
    batches the product (BATCH_MATMUL)."""
    if op.kind == "dot_general":
        return True
    return op.kind == "einsum" and all(
        len(w.channel_axes) + len(w.contraction_axes or ()) + len(w.stacked_axes) == len(w.shape)
        for w in op.operands if w.role == "weight")


def dynamic_input_spec(op: Op, rule: Rule | None, rows: bool = False) -> QuantSpec | None:
    """What a dynamic-range matmul/conv kernel quantizes its float inputs to
    (`rows`: a ``dot_general`` with one activation input quantizes it per
    row, as `odmlq.plan._passes.dynamic_per_row` says)."""
    if (op.kind not in MATMUL_KINDS or rule is None or rule.skip or not rule.act_dynamic
            or rule.act_qtype is None):
        return None
    inputs = [o for o in op.operands if o.role == "input"]
    axes = ()
    if rows and matmul_of_rows(op) and len(inputs) == 1 and inputs[0].contraction_axes:
        axes = tuple(a for a in range(len(inputs[0].shape)) if a not in inputs[0].contraction_axes)
    elif rows and op.kind == "conv" and len(inputs) == 1 and op.attributes.get("pointwise") is not None:
        # A 1x1 convolution XNNPACK runs as a matmul over pixels: a range per pixel.
        axes = tuple(a for a in range(len(inputs[0].shape)) if a != op.attributes["pointwise"])
    return QuantSpec(qtype=lookup_qtype(rule.act_qtype).name, symmetric=rule.resolved("act_symmetric"),
                     scale_axes=axes, dynamic=True)


def weight_spec(op: Op, operand: Operand, rule: Rule, index: int,
                channel_axes_limit: int | None = None, param_shape: tuple[int, ...] | None = None) -> QuantSpec:
    """`operand`'s spec under `rule`. `param_shape`: the parameter's own shape, in
    whose axes the channel, contraction and block axes are counted (the operand
    may read it transposed: a tied embedding as the output projection)."""
    qt = lookup_qtype(rule.weight_qtype)
    granularity = rule.resolved("weight_granularity")
    symmetric = rule.resolved("weight_symmetric")
    where = f"op {op.id!r} (rules[{index}]), weight {operand.param!r} of shape {operand.shape}"
    ndim = len(operand.shape)
    stacked = tuple(operand.stacked_axes)
    block_axis = block_size = None
    if isinstance(granularity, PerTensor):
        axes = ()
    elif isinstance(granularity, PerChannel) and granularity.axis is not None:
        axes = (_normalize_axis(granularity.axis, ndim, where),)
    else:
        if operand.channel_axes is None:
            raise GranularityError(
                f"{where}: its output-channel axes cannot be traced back to the parameter's "
                "layout; give the axis explicitly, e.g. PerChannel(axis=-1), or use PerTensor()."
            )
        axes = tuple(operand.channel_axes)
        if (channel_axes_limit is not None and len(axes) > channel_axes_limit
                and not isinstance(granularity, PerBlock)):
            axes = ()  # the target's tensors take fewer quantized dimensions: per tensor
        if isinstance(granularity, PerBlock):
            block_size = granularity.size
            if granularity.axis is not None:
                block_axis = _normalize_axis(granularity.axis, ndim, where)
            elif operand.contraction_axes is not None and len(operand.contraction_axes) == 1:
                block_axis = operand.contraction_axes[0]
            elif op.kind == "gather" and ndim == 2:
                # An embedding table's rows are looked up whole: blocks along each row (the
                # axis a tied output projection, x @ table.T, contracts), scales per row.
                block_axis, axes = 1, (0,)
            else:
                raise GranularityError(
                    f"{where}: PerBlock needs one contraction axis, found "
                    f"{operand.contraction_axes}; give it: PerBlock({block_size}, axis=...)."
                )
            size = (param_shape or operand.shape)[block_axis]
            if size % block_size:
                divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 256]
                raise GranularityError(
                    f"{where}: block size {block_size} does not divide axis {block_axis} of "
                    f"size {size}; choose a divisor such as {divisors[-4:]}, or give this module a rule of "
                    f"its own before this one (e.g. Rule({op.module_path!r}, "
                    f"weight_qtype={rule.weight_qtype!r}, weight_granularity=PerChannel()))."
                )
            axes = tuple(a for a in axes if a != block_axis)
    return QuantSpec(
        qtype=qt.name, scale_axes=tuple(sorted(set(stacked + axes))), block_axis=block_axis,
        block_size=block_size, symmetric=symmetric, narrow_range=symmetric and qt.is_integer,
        calibration=rule.resolved("weight_calibration"), algorithm=_algorithm(op, operand, rule, where),
    )


def _algorithm(op: Op, operand: Operand, rule: Rule, where: str):
    """The rule's weight algorithm where it applies: a matmul or convolution's
    kernel (a norm's scale or a bias is rounded to nearest)."""
    algorithm = rule.resolved("weight_algorithm")
    if (isinstance(algorithm, Nearest) or op.kind not in MATMUL_KINDS or operand.role != "weight"
            or not lookup_qtype(rule.weight_qtype).is_integer):  # an explicit one was refused by the rule
        return None
    if operand.stacked_axes:
        if not algorithm.required:
            return None
        raise PlanError(
            f"{where}: {algorithm!r} rounds one layer's weight against that layer's inputs, but this "
            f"weight stacks layers along axes {list(operand.stacked_axes)} (nn.scan); add a rule "
            "for this module with weight_algorithm=odmlq.Nearest().")
    return algorithm


def _normalize_axis(axis: int, ndim: int, where: str) -> int:
    if not -ndim <= axis < ndim:
        raise GranularityError(f"{where}: axis {axis} is out of range for a {ndim}-d tensor.")
    return axis % ndim


def act_spec(edge: Edge, rule: Rule, index: int) -> QuantSpec:
    qt = lookup_qtype(rule.act_qtype)
    granularity = rule.resolved("act_granularity")
    axes: tuple[int, ...] = ()
    if isinstance(granularity, PerChannel):
        where = f"edge {edge.id!r} (rules[{index}]) of shape {edge.shape}"
        axis = -1 if granularity.axis is None else granularity.axis
        axes = (_normalize_axis(axis, len(edge.shape), where),)
    symmetric = rule.resolved("act_symmetric")
    return QuantSpec(
        qtype=qt.name, scale_axes=axes, symmetric=symmetric, narrow_range=False,
        calibration=None if rule.act_dynamic else rule.resolved("act_calibration"),
        dynamic=rule.act_dynamic,
    )
