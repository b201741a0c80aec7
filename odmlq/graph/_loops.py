"""How a loop (a `scan`) is laid out in the graph: its body's ops named under
the loop, its edges aliased to what they carry (internal; a mixin of
`_grouping._Builder`, whose ops, edges and naming it uses)."""

from __future__ import annotations

import dataclasses
import os

from odmlq.graph._program import _Lit, _OpRec, _Program, _Region


class _LoopLayout:
    def lay_out_scan(self, program: _Program, rec: _OpRec) -> None:
        region: _Region = rec.steps[0]
        body = region.body
        nc = region.eqn.params["num_consts"]
        for v, r in zip(body.invars, region.ins):
            if not isinstance(r, _Lit) and r in self.path_of_value:
                self.path_of_value[v] = self.path_of_value[r]
        inner_start = len(self.ops)  # where the body's ops begin, and the loop op goes
        # Name the body first: the loop's module path is what its body shares.
        rec.id = "<scan>"
        self.name_body_inputs(program, region)
        self.name_and_lay_out(body, rec.body)
        self.alias_started_carries(program, region, nc)
        body_ops = self.ops[inner_start:]
        paths = [op.module_path for op in body_ops] or [self.module_path(rec)]
        rec.module_path = os.path.commonpath(["/" + p for p in paths]).strip("/")
        rec.id = self.new_id(rec.module_path, "scan")
        program.op_of[id(region)] = rec.id
        self.ops[inner_start:] = [dataclasses.replace(op, region=rec.id) for op in body_ops]
        self.rename_body_inputs(body, rec.id)
        names = [f"{rec.id}:{i}" for i in range(len(region.outs))]
        for i, (v, name) in enumerate(zip(region.outs, names)):
            inner = body.outvars[i]
            alias = body.edge_of.get(inner) if not isinstance(inner, _Lit) else None
            self.add_edge(program, v, name, producer=rec.id, alias=alias)
            self.path_of_value[v] = rec.module_path
        loop = self.make_op(rec, program, names)
        loop.attributes.update(num_carry=int(region.eqn.params["num_carry"]), length=int(region.eqn.params["length"]),
                               carries=self.carries(program, region, nc))
        self.ops.insert(inner_start, loop)

    def name_body_inputs(self, program: _Program, region: _Region) -> None:
        """A body input aliases the outer edge it reads (a constant, a step's
        slice of a stacked input), but for a carry the body rewrites: from the
        second step on that holds what the body wrote (a residual stream
        through `nn.scan`-stacked layers grows at every layer), so it is an
        edge of its own, quantized at every step on one scale for them all."""
        body = region.body
        nc, ncarry = region.eqn.params["num_consts"], region.eqn.params["num_carry"]
        for i, (v, r) in enumerate(zip(body.invars, region.ins)):
            if isinstance(r, _Lit) or v in self.w.weights:
                continue
            outer = program.edge_of.get(r)
            rewritten = nc <= i < nc + ncarry and body.outvars[i - nc] is not v
            self.add_edge(body, v, f"<scan>:in_{i}", producer=None, alias=None if rewritten else outer)

    def alias_started_carries(self, program: _Program, region: _Region, nc: int) -> None:
        """A carry the model starts from a constant (an RNN's zero state) has no
        outer edge to alias: from the second step on it carries what the body
        wrote to it, so it aliases that output (one quantization for the state
        at every step, the start included). One started from an outer edge
        stays an edge of its own (`name_body_inputs`)."""
        body = region.body
        for i in range(region.eqn.params["num_carry"]):
            name = body.edge_of.get(body.invars[nc + i])
            written = body.outvars[i]
            start = region.ins[nc + i]
            if (name is None or self.edges[name].alias is not None or isinstance(written, _Lit)
                    or body.edge_of.get(written) in (None, name)
                    or (not isinstance(start, _Lit) and program.edge_of.get(start) is not None)):
                continue
            self.edges[name] = dataclasses.replace(self.edges[name], alias=body.edge_of[written])

    def carries(self, program: _Program, region: _Region, nc: int) -> tuple:
        """``(carry edge, start edge, written edge)`` of each carry that is an
        edge of its own (`name_body_inputs`): one grid for the carry at every
        step and what the body writes to it (`scales._edges`); the start is
        requantized to it."""
        body, out = region.body, []
        for i in range(region.eqn.params["num_carry"]):
            carry, written = body.edge_of.get(body.invars[nc + i]), body.outvars[i]
            if carry is None or self.edges[carry].alias is not None or isinstance(written, _Lit):
                continue
            out.append((carry, program.edge_of.get(region.ins[nc + i]), body.edge_of.get(written)))
        return tuple(out)

    def rename_body_inputs(self, body: _Program, scan_id: str) -> None:
        for v, name in list(body.edge_of.items()):
            if name.startswith("<scan>:"):
                new = scan_id + name[len("<scan>"):]
                self.edges[new] = dataclasses.replace(self.edges.pop(name), id=new)
                body.edge_of[v] = new
        self.ops[:] = [
            dataclasses.replace(op, operands=tuple(
                dataclasses.replace(o, edge=scan_id + o.edge[len("<scan>"):])
                if o.edge and o.edge.startswith("<scan>:") else o for o in op.operands))
            for op in self.ops
        ]


def loop_edges(graph) -> frozenset[str]:
    """The edges that take a value at every step of a loop: those its body's
    ops compute, and its carries that are edges of their own."""
    return frozenset([*(e for op in graph.ops if op.region is not None for e in op.outputs),
                      *(c for op in graph.ops for c, _, _ in op.attributes.get("carries", ()))])
