"""Renders a Plan as aligned text tables (what `print(plan)` shows)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, ["-" * w for w in widths], *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths)] + [str(row[-1])]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


def named_list(names: Sequence[str], limit: int = 12, where: str = "") -> str:
    """'a, b, c and 40 more (`where` lists them all)': a list a person can read.

    A model with a loop unrolled into its file names hundreds of tensors; printed
    whole, they bury the lines above them."""
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    if more <= 0:
        return shown
    return shown + f" and {more} more" + (f" ({where} lists them all)" if where else "")


def _rule(index) -> str:
    return "-" if index is None else str(index)


def render(plan) -> str:
    g = plan.graph
    n_weights = sum(1 for p in plan.ops.values() for w in p.weights if w.spec is not None)
    n_edges = sum(1 for e in plan.edges.values() if e.spec is not None)
    out = [
        f"Plan for {g.model_name} ({g.framework}): {len(g.ops)} ops, {len(g.edges)} edges, "
        f"{len(plan.rules)} rule{'s' if len(plan.rules) != 1 else ''}; {n_weights} quantized weights, {n_edges} quantized edges",
        "",
        "Ops",
    ]
    rows = []
    for op in g.ops:
        op_plan = plan.ops[op.id]
        name = ("  " if op.region else "") + op.id
        weights = [f"{w.param}: {w.spec.describe() if w.spec else (w.note or 'float')}"
                   for w in op_plan.weights]
        weights += [f"constant {i}: {c.describe()} (scale from its value)"
                    for i, c in enumerate(op_plan.constants) if c is not None]
        rows.append([name, op.kind, op.module_path or "''", _rule(op_plan.rule),
                     weights[0] if weights else "-"])
        rows.extend(["", "", "", "", w] for w in weights[1:])
    out.append(table(["op", "kind", "module", "rule", "weights"], rows))
    out += ["", "Edges"]
    rows = []
    for edge in g.edges.values():
        e = plan.edges[edge.id]
        flags = ("in " if edge.is_input else "") + ("out" if edge.is_output else "")
        rows.append([edge.id, "x".join(map(str, edge.shape)) or "scalar", edge.dtype, flags.strip(),
                     _rule(e.rule), e.spec.describe() if e.spec else "float", e.reason])
    out.append(table(["edge", "shape", "dtype", "io", "rule", "spec", "decided by"], rows))
    floats = [o for o in plan.float_ops]
    if floats:
        out += ["", f"Float ops ({len(floats)}): " + ", ".join(floats)]
    if plan.unmatched_rules:
        out += ["", "Rules that matched nothing: " + ", ".join(
            f"rules[{i}] {plan.rules[i].module_path!r}" for i in plan.unmatched_rules)]
    return "\n".join(out)
