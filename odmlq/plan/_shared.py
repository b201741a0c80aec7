"""One spec for a parameter that several ops read (internal; `plan_graph` calls it)."""

from __future__ import annotations

import dataclasses

__all__ = ["share_weight_specs"]


def share_weight_specs(op_plans: dict) -> None:
    """A parameter several ops read (a tied embedding: a gather and the output
    projection) is stored once, so it gets one spec: where the ops' specs
    differ only in granularity, the scale axes they share (per tensor for a
    gather and a per-channel matmul) and the blocks they all have, and a
    weight algorithm only where every reader names it (GPTQ rounds against a
    matmul's inputs; a gather has none). Other differences stay, and
    `Plan.weight_specs` names them."""
    uses: dict[str, list[tuple[str, int]]] = {}
    for op_id, op_plan in op_plans.items():
        for i, w in enumerate(op_plan.weights):
            if w.spec is not None:
                uses.setdefault(w.param, []).append((op_id, i))
    for param, places in uses.items():
        specs = [op_plans[o].weights[i].spec for o, i in places]
        if len(set(specs)) <= 1:
            continue
        plain = {dataclasses.replace(s, scale_axes=(), block_axis=None, block_size=None, algorithm=None)
                 for s in specs}
        if len(plain) != 1:
            continue
        axes = tuple(sorted(set.intersection(*(set(s.scale_axes) for s in specs))))
        algorithms = {s.algorithm for s in specs}
        # Blocks that every reader runs along the same axis stay (a table's rows, which
        # its tied projection contracts).
        blocks = {(s.block_axis, s.block_size) for s in specs}
        block_axis, block_size = blocks.pop() if len(blocks) == 1 else (None, None)
        shared = dataclasses.replace(plain.pop(), scale_axes=axes, block_axis=block_axis, block_size=block_size,
                                     algorithm=algorithms.pop() if len(algorithms) == 1 else None)
        readers = ", ".join(o for o, _ in places)
        for op_id, i in places:
            weights = list(op_plans[op_id].weights)
            weights[i] = dataclasses.replace(weights[i], spec=shared,
                                             note=f"one spec for the ops that read it ({readers})")
            op_plans[op_id] = dataclasses.replace(op_plans[op_id], weights=tuple(weights))
