"""Low-rank adapters (LoRA) on the matmuls rules match, over a base stored as the rules say (QLoRA).

`odmlq.lora(model, rules, example_inputs, variables=..., rank=8, alpha=16)`
plans the model with the rules, as `ptq` and `export_tflite` do, and
returns a `LoRA`:

- **The frozen base** (`LoRA.frozen`): the model's params with every weight
  the rules quantize stored as that `QArray` (int4 or nf4 in blocks, int8
  per channel: the plan's grid, rounded to nearest), and every other leaf
  as it was. It is what training holds in memory (`LoRA.base_bytes`; an nf4
  base in blocks of 64 is about 0.14x the float bytes of what it stores).
  A weight no rule quantizes stays float (``rules=[]``: plain LoRA).
- **Adapters** (`LoRA.adapters`): for each weight that a matmul, einsum or
  convolution matched by a rule (not a skip rule), or by the ``adapt``
  pattern where one is given, reads, ``a`` of shape
  ``(inputs, rank)`` and ``b`` of shape ``(rank, outputs)``, where inputs
  are the weight's contracted axes flattened and outputs its output
  axes (a loop's stacked axes lead both); ``a`` uniform in
  ``±1/sqrt(inputs)``, ``b`` zero, so training starts at the base model.
  The weight the model computes with is
  ``dequantize(base) + (alpha / rank) * a @ b``, laid back out in the
  weight's own axes, so every op that reads the weight (a tied embedding's
  lookup too) sees the adapted one.
- `LoRA.apply(adapters, *inputs, frozen=...)` runs the model's own apply
  (Linen) or call (NNX) on those weights: differentiable in the adapters,
  jittable, the base dequantized inside the computation (never stored in
  float). Serving on XLA this way keeps the adapters apart from the base.
- `LoRA.merge(adapters)` gives float params, laid out as the model's, with
  the adapters folded in: give them to `odmlq.ptq` or `odmlq.export_tflite`
  (with the rules the deployment wants).

Activation fields of the rules play no part in training (QLoRA computes in
float); the same rules quantize the merged model's activations when it is
exported.

Example:
  >>> rules = [odmlq.Rule('.*', weight_qtype='nf4', weight_granularity=odmlq.PerBlock(64))]
  >>> l = odmlq.lora(model, rules, (x[:1],), variables=variables, rank=8, alpha=16)
  >>> loss = lambda adapters, frozen, x, y: cross_entropy(l.apply(adapters, x, frozen=frozen), y)
  >>> grads = jax.jit(jax.grad(loss))(l.adapters, l.frozen, x, y)
  >>> merged = l.merge(trained_adapters)
  >>> odmlq.export_tflite(model, int8_rules, batches, 'model.tflite', variables=merged)

References:
  Hu et al., LoRA: Low-Rank Adaptation of Large Language Models, 2021.
  Dettmers et al., QLoRA: Efficient Finetuning of Quantized LLMs, 2023.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq import xla
from odmlq.algorithms import GPTQ
from odmlq.errors import PlanError, RuleError
from odmlq.graph import MATMUL_KINDS, is_keras, merge_nnx, param_path, params_for, params_tree, split_nnx
from odmlq.plan import plan as plan_for_targets
from odmlq.qarray import QArray
from odmlq.rules import Rule
from odmlq.scales import weight_scale

__all__ = ["LoRA", "Placement", "lora"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an adapter's product goes in its weight.

    Attributes:
      param: the weight's parameter path.
      shape: the weight's shape.
      stacked: axes a loop slices (one adapter per slice), then the
        contracted axes, then the output axes, of the weight.
    """

    param: str
    shape: tuple[int, ...]
    stacked: tuple[int, ...]
    contracted: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def inputs_size(self) -> int:
        return math.prod(self.shape[a] for a in self.contracted)

    @property
    def outputs_size(self) -> int:
        return math.prod(self.shape[a] for a in self.outputs)

    def delta(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """``a @ b`` (per stacked slice) laid out as the weight."""
        product = jnp.einsum("...kr,...rn->...kn", a, b)
        order = self.stacked + self.contracted + self.outputs
        product = product.reshape(tuple(self.shape[i] for i in order))
        return jnp.transpose(product, np.argsort(order))


def lora(model: Any, rules: Sequence[Rule], example_inputs: Sequence[Any], *, variables: Any = None,
         rank: int = 8, alpha: float | None = None, adapt: str | None = None, seed: int = 0) -> "LoRA":
    """Adds low-rank adapters to the matmuls `rules` match (see the module doc).

    Args:
      model: a Linen module (pass `variables`) or an NNX module.
      rules: how the frozen base stores each weight (the rules' weight
        fields; a weight no rule quantizes stays float: ``[]`` is plain
        LoRA), and, unless `adapt` is given, which ops get adapters: the
        matmuls, einsums and convolutions a rule matches (a skip rule keeps
        its ops without one).
      example_inputs: inputs fixing the traced shapes (one row is enough).
      rank: the adapters' rank.
      alpha: the adapters' product is scaled by ``alpha / rank`` (default:
        `rank`, a scale of 1).
      adapt: a regex (full match, as `Rule.module_path`) choosing the
        matmuls that get adapters by module path, whatever the rules match:
        ``'.*attention/(query|value)'`` adapts those two projections over a
        base the rules quantize everywhere.
      seed: seeds the ``a`` matrices.

    Raises:
      RuleError: a rank that is not a positive integer; a rule asks for a
        weight algorithm that needs calibration data (GPTQ): the base is
        rounded to nearest.
      PlanError: no op gets an adapter; a matched weight has axes that are
        neither contracted nor output axes; a Keras model.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise RuleError(f"odmlq.lora: rank={rank!r}; give a positive integer, such as 8.")
    if is_keras(model):
        raise PlanError("odmlq.lora trains Linen and NNX modules; a Keras model is not supported. Train "
                        "its adapters with Keras (layer.enable_lora) and quantize the merged model.")
    rules = list(rules)
    params = params_tree(params_for(model, variables, "odmlq.lora"))
    plan = plan_for_targets(model, rules, *example_inputs, variables=variables, target=(xla.TARGET,))
    placements = _placements(plan, rules, adapt)
    keys = jax.random.split(jax.random.key(seed), max(len(placements), 1))
    adapters = {}
    for key, placement in zip(keys, placements.values()):
        stacked = tuple(placement.shape[i] for i in placement.stacked)
        bound = 1.0 / math.sqrt(placement.inputs_size)
        adapters[placement.param] = {
            "a": jax.random.uniform(key, stacked + (placement.inputs_size, rank), jnp.float32, -bound, bound),
            "b": jnp.zeros(stacked + (rank, placement.outputs_size), jnp.float32)}
    frozen = _stored(params, plan)
    return LoRA(model, plan, frozen, adapters, placements,
                scaling=(rank if alpha is None else float(alpha)) / rank, rank=rank)


def _placements(plan, rules: Sequence[Rule], adapt: str | None) -> dict[str, Placement]:
    """Parameter path -> where its adapter goes, for each weight of a matched
    matmul (in the order the model first reads them)."""
    try:
        pattern = None if adapt is None else re.compile(adapt)
    except (re.error, TypeError) as e:
        raise RuleError(f"odmlq.lora: adapt={adapt!r} is not a regular expression ({e}).") from None
    out: dict[str, Placement] = {}
    for op in plan.graph.ops:
        decided = plan.ops[op.id]
        chosen = (decided.rule is not None and not decided.skip) if pattern is None else bool(
            pattern.fullmatch(op.module_path))
        if op.kind not in MATMUL_KINDS or not chosen:
            continue
        for operand in op.operands:
            if operand.role != "weight" or operand.param is None or operand.derived or operand.param in out:
                continue
            shape = tuple(plan.graph.params[operand.param][0])
            contracted, outputs = operand.contraction_axes, operand.channel_axes
            stacked = tuple(operand.stacked_axes)
            if op.kind == "conv" and outputs is not None:  # a kernel's window axes are summed over too
                contracted = tuple(a for a in range(len(shape)) if a not in stacked + tuple(outputs))
            covered = None if contracted is None or outputs is None else sorted(stacked + contracted + outputs)
            if covered != list(range(len(shape))) or not contracted or not outputs:
                fix = (f"put Rule({op.module_path!r}, skip=True) before rules[{decided.rule}]" if pattern is None
                       else "leave it out of the adapt pattern")
                raise PlanError(
                    f"op {op.id!r} (module {op.module_path!r}) reads weight {operand.param!r} of shape "
                    f"{shape} with contracted axes {contracted} and output axes {outputs}; an adapter needs "
                    f"every axis to be one or the other. Keep this module without an adapter: {fix}.")
            out[operand.param] = Placement(operand.param, shape, stacked, tuple(contracted), tuple(outputs))
    if not out:
        kinds = ", ".join(sorted(MATMUL_KINDS))
        chooser = (f"no rule of {len(rules)} matches a" if pattern is None
                   else f"adapt={adapt!r} matches the module path of no")
        raise PlanError(f"odmlq.lora: {chooser} matmul reading a weight ({kinds}): nothing would "
                        "train. Check the pattern against the module paths print(odmlq.plan(...)) shows; "
                        "for plain LoRA over a float base pass rules=[] and adapt='.*'.")
    return out


def _stored(params: Any, plan) -> Any:
    """`params` with every weight the plan quantizes as its QArray (to nearest)."""
    specs = plan.weight_specs()
    for path, spec in specs.items():
        if isinstance(spec.algorithm, GPTQ) and spec.algorithm.required:
            raise RuleError(
                f"Weight {path!r}: odmlq.lora stores the frozen base rounded to nearest, but its rule asks "
                "for GPTQ, which needs calibration data; use weight_algorithm=odmlq.Nearest() (or leave it "
                "unset) for the base.")

    def store(path, leaf):
        spec = specs.get(param_path(path))
        if spec is None or isinstance(leaf, QArray):
            return leaf
        values = np.asarray(leaf, np.float32)
        return weight_scale(values, spec).quantize(values)

    return jax.tree_util.tree_map_with_path(store, params, is_leaf=_is_qarray)


def _is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)


def _bytes(tree: Any) -> int:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_qarray)
    return sum(x.nbytes if isinstance(x, QArray) else math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
               for x in leaves)


class LoRA:
    """A model with low-rank adapters over a frozen base (made by `odmlq.lora`).

    Attributes:
      plan: the Plan of the rules (what each weight of the base is stored as).
      frozen: the base params (QArrays where the rules quantize weights).
      adapters: the adapters training starts from: parameter path ->
        ``{'a': ..., 'b': ...}``, a pytree for any optimizer.
      placements: parameter path -> `Placement`.
      scaling: ``alpha / rank``.
      rank: the adapters' rank.
    """

    def __init__(self, model: Any, plan, frozen: Any, adapters: dict, placements: Mapping[str, Placement], *,
                 scaling: float, rank: int):
        from flax import nnx

        self.plan, self.frozen, self.adapters = plan, frozen, adapters
        self.placements, self.scaling, self.rank = dict(placements), scaling, rank
        # An NNX module holds its float weights: keep only its structure and random state.
        self._linen, self._nnx = model, None
        if isinstance(model, nnx.Module):
            graphdef, random_state, _ = split_nnx(model)
            self._linen, self._nnx = None, (graphdef, random_state)

    @property
    def base_bytes(self) -> int:
        """Bytes the frozen base holds (QArrays: their stored integers and scales)."""
        return _bytes(self.frozen)

    @property
    def float_bytes(self) -> int:
        """Bytes the base would hold in float32 (every leaf at 4 bytes an element)."""
        leaves = jax.tree_util.tree_leaves(self.frozen, is_leaf=_is_qarray)
        return sum(4 * math.prod(x.shape) if isinstance(x, QArray) else math.prod(np.shape(x)) * np.dtype(
            x.dtype).itemsize for x in leaves)

    @property
    def adapter_count(self) -> int:
        """Trainable values in the adapters."""
        return sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(self.adapters))

    def weights(self, adapters: Mapping[str, Mapping[str, jax.Array]], frozen: Any = None) -> Any:
        """Float params laid out as the model's: the base dequantized, each
        adapted weight plus ``scaling * a @ b`` (jittable)."""
        frozen = self.frozen if frozen is None else frozen
        unknown = sorted(set(adapters) - set(self.placements))
        if unknown:
            raise PlanError(f"Adapters for {unknown[:5]} have no place in this model; pass LoRA.adapters "
                            "(trained), keyed by the parameter paths it made them for.")

        def weight(path, leaf):
            name = param_path(path)
            value = leaf.dequantize() if isinstance(leaf, QArray) else leaf
            if name in adapters:
                delta = self.placements[name].delta(adapters[name]["a"], adapters[name]["b"])
                value = value + (self.scaling * delta).astype(value.dtype)
            return value

        return jax.tree_util.tree_map_with_path(weight, frozen, is_leaf=_is_qarray)

    def apply(self, adapters: Mapping[str, Mapping[str, jax.Array]], *inputs: Any, frozen: Any = None,
              **kwargs: Any) -> Any:
        """The model's outputs with the adapters (differentiable in them, jittable).

        Args:
          adapters: `LoRA.adapters`, or trained ones.
          frozen: the base (default `LoRA.frozen`). Under `jax.jit`, pass it
            as an argument, so the jitted program takes it as an input
            rather than copying it in as constants.
          kwargs: passed to the model's apply (Linen: ``rngs``, ``mutable``,
            its own keywords) or call (NNX; state the call updates, such as
            a BatchNorm's statistics in training mode, is not kept).
        """
        params = self.weights(adapters, frozen)
        if self._nnx is None:
            return self._linen.apply(params, *inputs, **kwargs)
        graphdef, random_state = self._nnx
        return merge_nnx(graphdef, random_state, params)(*inputs, **kwargs)

    def merge(self, adapters: Mapping[str, Mapping[str, jax.Array]], frozen: Any = None) -> Any:
        """Float params with the adapters folded in (numpy), laid out as the
        model's (Linen variables; an NNX module's state): pass them as
        `variables` to `odmlq.ptq`, `odmlq.export_tflite` or `odmlq.qat`."""
        return jax.tree.map(np.asarray, jax.jit(self.weights)(adapters, frozen if frozen is not None
                                                                 else self.frozen))

    def __repr__(self) -> str:
        return (f"LoRA({len(self.placements)} adapted weights, rank {self.rank}, scaling {self.scaling:g}, "
                f"{self.adapter_count:,} adapter values; base {self.base_bytes:,} bytes, "
                f"{self.base_bytes / max(self.float_bytes, 1):.2f}x float)")
