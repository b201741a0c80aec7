"""Which tensor of a LiteRT model carries which plan edge and conversion (internal).

Verification (`odmlq.litert.verify`) and the reports (`odmlq.report`) read a
model's intermediate tensors by plan edge. The export names every tensor
after the ops fused into it (``jit(fn)/<op id>/...``), and each conversion's
QUANTIZE ``<edge>/to_<qtype>`` (`odmlq.litert._annotate`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from odmlq.graph import MOVES_VALUES, STEP_SCOPE, repeated_edges
from odmlq.litert._islands import constant_derived

__all__ = ["as_edge", "dequantize_tensor", "float_island_outputs", "layout_copies", "map_conversions", "map_float_tensors",
           "map_steps", "map_tensors", "params_match", "produced_tensors"]

# The scope of what the export computes from an op's input, inside the op's
# own scope, to lay it out for its kernel (a 1-D convolution's input given an
# axis of size 1): such a tensor is named for no edge.
INPUT_LAYOUT = "input_layout"
_JIT_PREFIX = re.compile(r"^jit\((?:[^()]|\([^()]*\))*\)/")


def map_tensors(details: Sequence[dict], produced: set[int], plan, scales,
                conversions: frozenset[int] = frozenset(), ops: Sequence[dict] = ()) -> dict[str, int]:
    """Plan edge id -> index of the tensor that carries it.

    A tensor's name lists the locations of the ops fused into it
    (``jit(fn)/conv1/relu/max;jit(fn)/conv1/conv/...``); the edge is the
    latest of the plan's edges named there. When several tensors name one
    edge (a requantized copy), the one whose scale and zero point are the
    edge's wins. A tensor of a conversion (in `conversions`, see
    `map_conversions`) carries an edge only where no other tensor does and
    it has the edge's size (the converter writes a broadcast's reshape of it
    as the same tensor; a reduction reading it is another tensor).

    With the model's `ops`, a layout copy (`layout_copies`) carries an edge
    only with the edge's scale and zero point: the converter names the RESHAPE
    that lays a matmul's input out for FULLY_CONNECTED after the matmul
    (diffusers' VAE attention), and the matmul's own output after the
    transpose it absorbed. Such a copy holds its input's value, checked
    under its own name, and can be no wrong kernel.

    An edge that repeats an earlier edge's computation on the same grid
    (`odmlq.graph.repeated_edges`) and has no tensor of its own takes the
    earlier one's: litert-converter keeps one tensor for both.
    """
    copies = layout_copies(ops, details)
    order = {e: i for i, e in enumerate(plan.graph.edges)}
    candidates: dict[str, list[int]] = {}
    first: set[int] = set()  # tensors whose first location names their edge
    for d in details:
        if d["index"] not in produced or d["dtype"] not in (np.int8, np.int16):
            continue
        named = _edges_named(d["name"], order)
        if named:
            edge = max(named, key=order.get)
            candidates.setdefault(edge, []).append(d["index"])
            if edge in _edges_named(d["name"].split(";")[0], order):
                first.add(d["index"])
    by_index = {d["index"]: d for d in details}
    out = {}
    for edge, indices in candidates.items():
        if edge not in scales.edges:
            continue
        size = _size(plan.graph.edges[edge].shape)
        # A conversion's tensor stands for an edge only as a reshape of it
        # (same size): it is named in its reader's scope, whatever that computes.
        indices = [i for i in indices if i not in conversions or _size(by_index[i]["shape"]) == size]
        indices = [i for i in indices if i not in copies or params_match(by_index[i], scales.edges[edge])]
        if not indices:
            continue
        matching = [i for i in indices if params_match(by_index[i], scales.edges[edge])]
        pool = matching or [i for i in indices if i not in conversions] or indices
        pool = [i for i in pool if i not in conversions] or pool
        # A tensor named after its own op first wins over one that names the
        # edge only in a later location: litert-converter lists a constant's
        # location shared by many ops (every LOGISTIC's `1 + exp(-x)` named after
        # the first sigmoid's ADD), and the last such tensor was taken.
        out[edge] = ([i for i in pool if i in first] or pool)[-1]
    # An edge that repeats an earlier one's computation on the same grid has
    # no tensor of its own: the converter kept one (`repeated_edges`), and the
    # ops that read the second read it.
    for edge, earlier in repeated_edges(plan.graph).items():
        ts = scales.edges.get(edge)
        if edge not in out and earlier in out and ts is not None and ts.same_grid(scales.edges.get(earlier)):
            out[edge] = out[earlier]
    return out


# LiteRT ops that only lay their first input's values out anew.
_LAYOUT_OPS = frozenset({"RESHAPE", "SQUEEZE", "EXPAND_DIMS"})


def layout_copies(ops: Sequence[dict], details: Sequence[dict]) -> set[int]:
    """Integer tensors a RESHAPE, SQUEEZE or EXPAND_DIMS writes from a tensor
    of the same scale and zero point: the same values in another shape."""
    by_index = {d["index"]: d for d in details}
    out = set()
    for op in ops:
        if op["op_name"] not in _LAYOUT_OPS or len(op["outputs"]) != 1 or not len(op["inputs"]):
            continue
        source, copy = by_index.get(int(op["inputs"][0])), by_index.get(int(op["outputs"][0]))
        if source is None or copy is None or copy["dtype"] not in (np.int8, np.int16):
            continue
        qs, qc = source["quantization_parameters"], copy["quantization_parameters"]
        if (source["dtype"] == copy["dtype"] and np.array_equal(qs["scales"], qc["scales"])
                and np.array_equal(qs["zero_points"], qc["zero_points"])):
            out.add(copy["index"])
    return out


def map_float_tensors(details: Sequence[dict], produced: Sequence[int], plan, scales,
                      ops: Sequence[dict] = (), inputs: Sequence[int] = (),
                      outputs: Sequence[int] = ()) -> dict[str, int]:
    """Float plan edge id (not quantized in `scales`) -> index of the float32
    tensor that carries it: of the tensors whose names end in the edge (as
    `map_tensors` reads them) and that hold its number of values, the last
    one the interpreter writes (an op the converter lowers to several, such
    as a transposed matmul, writes the edge's value last). A tensor computed
    from constants only (`ops`, the graph's `inputs`) carries no edge: a plan
    edge depends on the model's inputs, and a fused name can name one (XGLM's
    position lookup, folded to constants, was named for the token lookup too).

    A tensor whose name holds no location (``select_n``: the converter loses
    the SELECTs of a call it inlines, such as ``jax.nn.elu``'s) continues the
    op whose tensors it reads, and the model's output tensors (`outputs`, in
    the order of the graph's outputs) carry the graph's output edges."""
    order = {e: i for i, e in enumerate(plan.graph.edges)}
    by_index = {d["index"]: d for d in details}
    # Constants are the tensors ops read that no op writes and that are not graph inputs.
    live = {int(o) for op in ops for o in op["outputs"]} | {int(i) for i in inputs}
    constant = constant_derived(((op["inputs"], op["outputs"]) for op in ops),
                                {int(i) for op in ops for i in op["inputs"] if int(i) >= 0} - live)
    # What a RESHAPE writes is its input's value: of a tensor another op
    # computed, it carries an edge only that a layout op produces (the
    # converter names a FULLY_CONNECTED's input RESHAPE after the matmul:
    # diffusers' VAE attention); of the op's own (a BATCH_MATMUL's output laid
    # out as its einsum's: NNX attention), it is the op's result.
    copies = {int(op["outputs"][0]): int(op["inputs"][0]) for op in ops
              if op["op_name"] in _LAYOUT_OPS and len(op["outputs"]) == 1 and len(op["inputs"])}
    producer_of = {int(o): op for op in ops for o in op["outputs"]}
    named_of: dict[int, list[str]] = {}
    out: dict[str, int] = {}
    for index in produced:  # execution order: a later tensor of the same edge wins
        d = by_index.get(index)
        if d is None:
            continue
        named = _edges_named(d["name"], order)
        if not named and "/" not in d["name"] and index not in outputs and index in producer_of:
            named = [e for i in producer_of[index]["inputs"] for e in named_of.get(int(i), ())]
        named_of[index] = named
        if not named or d["dtype"] != np.float32 or index in constant:
            continue
        edge = max(named, key=order.get)
        if (edge in scales.edges or plan.graph.edges[edge].alias is not None
                or not np.issubdtype(np.dtype(plan.graph.edges[edge].dtype), np.floating)):
            continue  # quantized, an alias, or a mask or index the float tensor was computed from
        producer = plan.graph.edges[edge].producer
        if (index in copies and edge not in named_of.get(copies[index], ())
                and (producer is None or plan.graph.op(producer).kind not in MOVES_VALUES)):
            continue
        if _size(d["shape"]) == _size(plan.graph.edges[edge].shape) and _reshaped(d["shape"],
                                                                                 plan.graph.edges[edge].shape):
            out[edge] = index
    for edge, index in zip(plan.graph.outputs, outputs if len(outputs) == len(plan.graph.outputs) else ()):
        d, e = by_index.get(int(index)), plan.graph.edges.get(edge)
        if (d is not None and e is not None and d["dtype"] == np.float32 and edge not in scales.edges
                and e.alias is None and not e.is_input and _size(d["shape"]) == _size(e.shape)):
            out[edge] = int(index)
    return out


def map_steps(details: Sequence[dict], produced: set[int], plan, scales,
              ops: Sequence[dict] = ()) -> dict[str, tuple[int | None, ...]]:
    """Edge computed inside a loop (or a loop's carry) -> the tensor of each
    step, in step order (None for a step without one).

    The export unrolls a loop (`lax.scan`: `nn.RNN`, `nn.scan`-stacked
    layers), each step's ops in a scope of their own
    (``<loop op id>/step_<i>/<edge>/...``: `odmlq.graph.STEP_SCOPE`). Each
    step's tensors are mapped as `map_tensors` maps the model's, for loops
    not inside another. A carry has a tensor of its own only where it is
    requantized (its start, at the first step); later steps read what the
    body wrote."""
    graph = plan.graph
    loops = {op.id: op for op in graph.ops if op.kind == "scan" and op.region is None}
    order = {e: i for i, e in enumerate(graph.edges)}
    steps: dict[tuple[str, int], list[dict]] = {}
    for d in details:
        # A step's tensor: every location in its name that is a step's is one step's,
        # and no other names a plan edge (a weight's, laid out before the loop, may
        # be there; the converter also lists a step's location in a tensor outside
        # the loop that shares a value with it).
        places, rests = set(), []
        for location in d["name"].split(";"):
            path = _JIT_PREFIX.sub("", location)
            loop = next((l for l in loops if path.startswith(f"{l}/{STEP_SCOPE}")), None)
            step, _, rest = ("", "", "") if loop is None else path[len(loop) + 1 + len(STEP_SCOPE):].partition("/")
            if step.isdigit():
                places.add((loop, int(step)))
                rests.append(rest)
            elif _edges_named(location, order):
                places.add(None)
        if len(places) == 1 and None not in places:
            steps.setdefault(places.pop(), []).append(dict(d, name=";".join(rests)))
    out: dict[str, tuple[int | None, ...]] = {}
    for loop_id, loop in loops.items():
        inside = [*(e for op in graph.ops if op.region == loop_id for e in op.outputs),
                  *(carry for carry, _, _ in loop.attributes.get("carries", ()))]
        found = [map_tensors(steps.get((loop_id, i), []), produced, plan, scales, ops=ops)
                 for i in range(loop.attributes.get("length", 0))]
        out.update({e: tuple(f.get(e) for f in found) for e in inside if any(e in f for f in found)})
    return out


def _edges_named(name: str, order: dict[str, int]) -> list[str]:
    """The plan edges a tensor's name ends in: each location's path and the
    paths above it (``a/b/c`` names edges ``a/b/c``, ``a/b`` and ``a``), looked
    up rather than compared with every edge."""
    named = []
    for location in name.split(";"):
        parts = _JIT_PREFIX.sub("", location).split("/")
        if INPUT_LAYOUT in parts:
            continue  # an op's input laid out for its kernel (`_annotate`): not the op's output
        named += [e for e in ("/".join(parts[:n]) for n in range(1, len(parts) + 1)) if e in order]
    return named


def _reshaped(shape, edge_shape) -> bool:
    """Whether a tensor of `shape` can hold the edge's values in its order: its
    axes split or merge the edge's (each boundary between its axes is one
    between the edge's, or the other way round). A BATCH_MATMUL's output that
    the converter transposes together with the op after it (NNX attention's
    einsum, then a transpose: (1, 2, 6, 8) for an edge (1, 1, 6, 2, 8)) has the
    size but not the order; simulate then computes the edge itself."""
    def boundaries(dims):
        return set(np.cumprod([int(n) for n in dims if int(n) != 1]).tolist())

    a, b = boundaries(shape), boundaries(edge_shape)
    return a <= b or b <= a


def _size(shape) -> int:
    return int(np.prod(shape)) if shape is not None else 1


def map_conversions(ops: Sequence[dict], details: Sequence[dict], plan, scales) -> dict[str, int]:
    """Conversion name (`odmlq.plan.conversion_name`) -> index of the integer
    tensor LiteRT's QUANTIZE writes for it (`Plan.conversions`).

    The export names that QUANTIZE ``<operand edge>/to_<qtype>`` in the scope
    of the op reading it (`odmlq.litert._annotate`); the operand edge may be an
    alias of the converted edge. Where several tensors carry one conversion,
    the one whose scale and zero point are the conversion's wins.

    A conversion read inside a loop has a tensor per unrolled step, and none
    stands for it: it is not mapped (each step's reader is checked fed that
    step's operand; one step's tensor fed to every step was thousands of LSB
    off, a mixed-rule NNX scan refused by verification).
    """
    graph = plan.graph
    scopes: dict[str, str] = {}  # "/<operand edge>/to_<qtype>/" -> conversion name
    for c in plan.conversions.values():
        if c.key not in scales.conversions or _read_in_a_loop(graph, c):
            continue
        for op_id in c.consumers:
            for operand in graph.op(op_id).operands:
                if operand.edge is not None and graph.resolve(operand.edge) == c.edge:
                    scopes[f"/{operand.edge}/to_{c.spec.qtype}/"] = c.name
    by_index = {d["index"]: d for d in details}
    found: dict[str, list[int]] = {}
    for op in ops:
        if op["op_name"] != "QUANTIZE" or len(op["outputs"]) != 1:
            continue
        out = by_index.get(int(op["outputs"][0]))
        if out is None or out["dtype"] not in (np.int8, np.int16):
            continue
        locations = ["/" + _JIT_PREFIX.sub("", loc) + "/" for loc in out["name"].split(";")]
        for scope, name in scopes.items():
            if any(scope in loc for loc in locations):
                found.setdefault(name, []).append(out["index"])
    keys = {c.name: c.key for c in plan.conversions.values()}
    return {name: ([i for i in indices if params_match(by_index[i], scales.conversions[keys[name]])]
                   or indices)[-1] for name, indices in found.items()}


def _read_in_a_loop(graph, conversion) -> bool:
    """A conversion an op inside a loop reads: a tensor per unrolled step
    (an edge computed inside a loop is read only there)."""
    return any(graph.op(o).region is not None for o in conversion.consumers)


def float_island_outputs(ops: Sequence[dict], details: Sequence[dict], plan) -> dict[str, int]:
    """Edge id -> the float32 tensor LiteRT quantizes for a conversion from a
    float edge (`Plan.conversions`): the input of the QUANTIZE whose output is
    named ``<edge>/to_<qtype>`` (see `odmlq.litert._annotate`). Not for a
    conversion read inside a loop: a tensor per step, none standing for it (as
    in `map_conversions`)."""
    wanted = {c.edge for c in plan.conversions.values()
              if c.source == "float" and not _read_in_a_loop(plan.graph, c)}
    by_index = {d["index"]: d for d in details}
    out: dict[str, int] = {}
    for op in ops:
        if op["op_name"] != "QUANTIZE" or len(op["inputs"]) != 1 or len(op["outputs"]) != 1:
            continue
        source = by_index.get(int(op["inputs"][0]))
        name = by_index[int(op["outputs"][0])]["name"]
        if source is None or source["dtype"] != np.float32:
            continue
        for edge in wanted:
            if f"/{edge}/to_int" in name or name.startswith(f"{edge}/to_int"):
                out[edge] = source["index"]
    return out


def as_edge(tensor, shape) -> np.ndarray | None:
    """A float tensor LiteRT computed, in its plan edge's shape: the converter
    may drop or add unit axes (a broadcast mask (1, 8) for an edge (1, 1, 8)).
    None where the sizes differ too: simulate then computes the edge itself."""
    x = np.asarray(tensor)
    if shape is None or x.size != int(np.prod(shape)):
        return None
    return x.reshape(shape)


def produced_tensors(interpreter) -> list[int]:
    """Indices of the tensors the interpreter's ops write, in execution order."""
    return list(dict.fromkeys(int(t) for op in interpreter._get_ops_details() for t in op["outputs"]))


def params_match(detail: dict, ts) -> bool:
    q = detail["quantization_parameters"]
    scale = np.asarray(ts.scale, np.float64).reshape(-1)
    zp = np.zeros(scale.shape, np.int64) if ts.zero_point is None else np.asarray(ts.zero_point).reshape(-1)
    return (q["scales"].shape == scale.shape and np.allclose(q["scales"], scale, rtol=1e-6, atol=0)
            and np.array_equal(q["zero_points"], zp))


def dequantize_tensor(value: np.ndarray, detail: dict) -> np.ndarray:
    q = detail["quantization_parameters"]
    return (value.astype(np.float32) - q["zero_points"].astype(np.float32)) * q["scales"].astype(np.float32)
