"""What a compared model computes in float, or converts between types (internal).

Two kinds, each with the reason: LiteRT ops that compute in float inside an
integer graph (float islands of the compared .tflite, with `inspect`'s reason
per op), and the conversions the plan places (an edge read by some ops in
another qtype: one QUANTIZE each on LiteRT).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class FloatOp:
    """One float island or conversion of a compared model.

    Attributes:
      kind: 'island' (a LiteRT op computing in float) or 'conversion' (an
        edge requantized for the ops that read it in another qtype).
      op: the LiteRT op name (islands) or the edge id (conversions).
      module_path: where in the model.
      why: the reason, in words.
      count: ops of the same name, module and reason folded into this row.
    """

    kind: str
    op: str
    module_path: str
    why: str
    count: int = 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FloatOp":
        return cls(kind=d["kind"], op=d["op"], module_path=d["module_path"], why=d["why"],
                   count=int(d.get("count", 1)))


def float_ops(plan, tflite: bytes | None) -> tuple[FloatOp, ...]:
    """The compared .tflite's float islands (same op, module and reason
    folded into one row with a count), then the plan's conversions."""
    rows: dict[tuple[str, str, str], int] = {}
    if tflite is not None:
        from odmlq.litert.inspect import inspect

        summary = inspect(bytes(tflite))
        for op in summary.float_islands:
            key = (op.name, op.module_path or "", summary.why_float(op) or "computes in float")
            rows[key] = rows.get(key, 0) + 1
    out = [FloatOp(kind="island", op=name, module_path=module, why=why, count=n)
           for (name, module, why), n in rows.items()]
    for c in plan.conversions.values():
        producer = plan.graph.edges[c.edge].producer
        module = plan.graph.op(producer).module_path if producer is not None else ""
        out.append(FloatOp(kind="conversion", op=c.edge, module_path=module,
                           why=f"{c.source} edge read as {c.spec.describe()} by {', '.join(c.consumers)}"))
    return tuple(out)
