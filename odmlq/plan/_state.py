"""State a model passes out and is given back: a KV cache (internal; `plan` reads it).

A decoder's ``decode(token, position, *cache)`` returns ``(logits, *cache)``,
and the caller feeds each returned cache tensor back as the same input at
the next call. `state` names those pairs by position among the model's
flattened inputs and outputs: ``{input index: output index}``. A pair is one
tensor across calls, so it takes one qtype and one scale (the output's,
which holds everything the input will hold: the old rows and the new one).
On XLA the quantized model then returns the state as a `QArray` and takes it
back as one, so it stays int8 between calls (`odmlq.xla.ptq`).
"""

from __future__ import annotations

from collections.abc import Mapping

from odmlq.errors import PlanError

__all__ = ["state_pairs", "check_state_specs"]


def state_pairs(graph, state: Mapping[int, int] | None) -> tuple[tuple[str, str], ...]:
    """``((input edge, output edge), ...)`` for ``{input index: output index}``.

    Raises:
      PlanError: an index out of range, an output fed back to two inputs, or
        a pair whose two tensors differ in shape or dtype.
    """
    if not state:
        return ()
    if not isinstance(state, Mapping):
        raise PlanError(f"state={state!r}: give a mapping {{input index: output index}}, e.g. "
                        "{2: 1, 3: 2} for decode(token, position, k, v) -> (logits, k, v).")
    pairs, taken = [], {}
    for i, o in sorted(state.items()):
        for index, edges, kind in ((i, graph.inputs, "input"), (o, graph.outputs, "output")):
            if not isinstance(index, int) or not 0 <= index < len(edges):
                raise PlanError(f"state={dict(state)}: {kind} {index!r} is not among the model's {len(edges)} "
                                f"flattened {kind}s (indices 0..{len(edges) - 1}).")
        if o in taken:
            raise PlanError(f"state={dict(state)}: output {o} is fed back as input {taken[o]} and as input {i}; "
                            "each output carries one input's state.")
        taken[o] = i
        source, result = graph.edges[graph.inputs[i]], graph.edges[graph.outputs[o]]
        if (tuple(source.shape), str(source.dtype)) != (tuple(result.shape), str(result.dtype)):
            raise PlanError(
                f"state={dict(state)}: input {i} ({source.dtype}{list(source.shape)}) and output {o} "
                f"({result.dtype}{list(result.shape)}) are not one tensor across calls; pair each state "
                "input with the output the caller feeds back as it.")
        pairs.append((graph.inputs[i], graph.outputs[o]))
    return tuple(pairs)


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
