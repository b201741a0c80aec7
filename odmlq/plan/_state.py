"""State a model passes out and is given back: a KV cache (internal; `plan` reads it).

A decoder's ``decode(token, position, *cache)`` returns ``(logits, *cache)``,
and the caller feeds each returned cache tensor back as the same input at
the next call. `state` names those pairs by position among the model's
arguments and returned items: ``{input index: output index}`` (a pytree
argument, such as a dict of cache arrays, is paired leaf by leaf). A pair is one
tensor across calls, so it takes one qtype and one scale (the output's,
which holds everything the input will hold: the old rows and the new one).
On XLA the quantized model then returns the state as a `QArray` and takes it
back as one, so it stays int8 between calls (`odmlq.xla.ptq`).
"""

from __future__ import annotations

from collections.abc import Mapping

from odmlq.errors import PlanError

__all__ = ["check_state_specs", "state_indices", "state_pairs"]


def state_pairs(graph, state: Mapping[int, int] | None) -> tuple[tuple[str, str], ...]:
    """``((input edge, output edge), ...)`` for ``{input index: output index}``:
    positions among the model's arguments and returned items, each pair's two
    pytrees (a dict of cache arrays, say) matched leaf by leaf.

    Raises:
      PlanError: an index out of range, an output fed back to two inputs, or
        a pair whose two sides differ in structure, shape or dtype.
    """
    if not state:
        return ()
    if isinstance(state, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in state):
        return state  # pairs of edges, as a Plan holds them
    if not isinstance(state, Mapping):
        raise PlanError(f"state={state!r}: give a mapping {{input index: output index}}, e.g. "
                        "{2: 1, 3: 2} for decode(token, position, k, v) -> (logits, k, v).")
    inputs, outputs = _items(graph)
    pairs, taken = [], {}
    for i, o in sorted(state.items()):
        for index, items, kind in ((i, inputs, "input"), (o, outputs, "output")):
            if not isinstance(index, int) or not 0 <= index < len(items):
                raise PlanError(f"state={dict(state)}: {kind} {index!r} is not among the model's {len(items)} "
                                f"{kind}s (indices 0..{len(items) - 1}, as it takes and returns them).")
        if o in taken:
            raise PlanError(f"state={dict(state)}: output {o} is fed back as input {taken[o]} and as input {i}; "
                            "each output carries one input's state.")
        taken[o] = i
        (source_tree, sources), (result_tree, results) = inputs[i], outputs[o]
        shapes = [[(tuple(graph.edges[e].shape), str(graph.edges[e].dtype)) for e in side]
                  for side in (sources, results)]
        if source_tree != result_tree or shapes[0] != shapes[1]:
            describe = [", ".join(f"{d}{list(shape)}" for shape, d in side) for side in shapes]
            raise PlanError(
                f"state={dict(state)}: input {i} ({describe[0]}) and output {o} ({describe[1]}) are not one "
                "tensor (or pytree of tensors) across calls; pair each state input with the output the "
                "caller feeds back as it.")
        pairs += zip(sources, results)
    return tuple(pairs)


def state_indices(graph, pairs) -> dict[int, int]:
    """``{input index: output index}`` of the pairs, as `plan` takes it."""
    inputs, outputs = _items(graph)
    where_in = {e: i for i, (_, edges) in enumerate(inputs) for e in edges}
    where_out = {e: o for o, (_, edges) in enumerate(outputs) for e in edges}
    return {where_in[source]: where_out[result] for source, result in pairs}


def _items(graph) -> tuple[list, list]:
    """The model's arguments and returned items, each as ``(structure, its edges)``:
    the traced pytrees where the graph holds its program, else one edge each."""
    def flat(edges):
        return [(None, (e,)) for e in edges]

    program = graph.program
    if program is None:
        return flat(graph.inputs), flat(graph.outputs)
    import jax

    def items(tree, edges, skip: int = 0):
        value = jax.tree_util.tree_unflatten(tree, list(range(tree.num_leaves)))
        parts = list(value)[skip:] if skip or isinstance(value, (tuple, list)) else [value]
        offset = sum(len(jax.tree_util.tree_leaves(p)) for p in list(value)[:skip]) if skip else 0
        return [(jax.tree_util.tree_structure(p), tuple(edges[j - offset] for j in jax.tree_util.tree_leaves(p)))
                for p in parts]

    try:
        return items(program.in_tree, graph.inputs, skip=1), items(program.out_tree, graph.outputs)
    except (IndexError, TypeError, ValueError):  # a layout the program does not describe: leaves
        return flat(graph.inputs), flat(graph.outputs)


def check_state_specs(graph, edges, pairs) -> None:
    """Each pair's two edges planned alike: both float, or both quantized
    statically with one spec.

    Raises:
      PlanError: naming the pair, each side's spec and the op whose rule decides it.
    """
    for source, result in pairs:
        a, b = edges[source].spec, edges[graph.resolve(result)].spec
        if a == b and (a is None or not a.dynamic):
            continue
        writer = graph.edges[graph.resolve(result)].producer
        reader = next(iter(graph.edges[source].consumers), None)
        if a is not None and b is not None and (a.dynamic or b.dynamic):
            problem = "is quantized at run time; state keeps one scale across calls"
            fix = "give the op that writes it a rule without act_dynamic"
        else:
            problem = (f"would cross calls as {_described(a)} but is written as {_described(b)}")
            fix = ("give the op that writes it and the op that first reads it the same act_qtype and "
                   "granularity (a rule matching both, e.g. Rule(path, op='select_n', writes_output=True, "
                   "act_qtype='int8'))")
        raise PlanError(f"State input {source!r} (read by {reader!r}) and output {result!r} (written by "
                        f"{writer!r}): the state {problem}; {fix}.")


def _described(spec) -> str:
    return "float" if spec is None else spec.describe()
