"""Which edges carry the outputs' error, measured on the outputs (internal).

An edge's local SQNR says how much error it introduces in its own units; what
matters is how much of the *outputs'* error it causes, which depends on
everything after it (a softmax input 40 dB off can take a language model's
logits to 15 dB). `contributions` measures it both ways, one at a time: the
outputs with only that edge quantized (what it costs alone), and with only
that edge in float, everything else as `simulate` quantizes it (what keeping
it float would buy). Edges sharing one scale count as one. One jitted
function serves every run: each edge's quantization is multiplied by an
entry of a mask it takes as an argument.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from odmlq.graph import GraphCache, params_for
from odmlq.hooks import FakeQuant, PlanHooks
from odmlq.report._fixes import output_sqnr
from odmlq.batches import leaves
from odmlq.scales import folded_weights, quantized_params

__all__ = ["contributions"]


class _Masked(FakeQuant):
    """Fake-quantizes the edges whose `keep` entry is 1, leaves those at 0 float."""

    def integer_sums(self, op) -> bool:
        return False  # an edge left float is on no grid

    def __init__(self, keep: jax.Array, index: Mapping[str, int]):
        self.keep, self.index = keep, index

    def edge(self, edge_id: str, x: jax.Array, ts) -> jax.Array:
        q = ts.fake_quant(x)
        i = self.index.get(edge_id)
        return q if i is None else x + self.keep[i] * (q - x)


def contributions(model: Any, plan, scales, inputs: Sequence[Any], float_outputs: Sequence[np.ndarray], *,
                  variables: Any = None, groups: Mapping[str, str] | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Edge id -> ``(alone, gain)`` for every statically quantized edge:
    `alone` the outputs' SQNR (dB, lowest output) with only that edge
    quantized (weights and everything else float), `gain` how much the
    outputs' SQNR rises with only that edge in float (everything else as
    simulate quantizes it).

    `groups`: edge id -> the edge whose scale it takes (a pool or reshape
    keeps its input's): a group is quantized or kept in float together, and
    each member gets the group's figures (one member alone in float would
    still be rounded by the others on the shared scale)."""
    graph = GraphCache(model, plan, variables).graph_for(tuple(inputs))
    edges = [e for e in scales.edges if e in graph.edges and graph.edges[e].alias is None]
    if not edges:
        return {}
    roots = list(dict.fromkeys((groups or {}).get(e, e) for e in edges))
    index = {e: roots.index((groups or {}).get(e, e)) for e in edges}
    folded = folded_weights(plan.graph, params_for(model, variables, "compare"), scales)
    quantized = quantized_params(folded, scales)

    def run(params, keep, *xs):
        return PlanHooks(plan, scales, _Masked(keep, index)).evaluate(graph, params, *xs)

    jitted = jax.jit(run)

    def sqnr(params, keep) -> float:
        return output_sqnr(list(float_outputs), leaves(jitted(params, keep, *inputs)))

    ones, zeros = jnp.ones(len(roots), jnp.float32), jnp.zeros(len(roots), jnp.float32)
    base = sqnr(quantized, ones)
    figures = []
    for i in range(len(roots)):
        gain = sqnr(quantized, ones.at[i].set(0.0)) - base if math.isfinite(base) else 0.0
        figures.append((sqnr(folded, zeros.at[i].set(1.0)), gain))
    return {e: figures[i] for e, i in index.items()}
