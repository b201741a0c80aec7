"""Which ops of a full-integer .tflite compute in float (internal; the
definition is in `odmlq.litert.inspect.inspect`)."""

from __future__ import annotations

FLOAT_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16"})


def constant_derived(ops, constants) -> set[int]:
    """`constants` and the tensors computed from them only: the outputs of ops
    (``(inputs, outputs)`` index pairs, in execution order) that read nothing else."""
    derived = set(constants)
    for inputs, outputs in ops:
        ins = [int(i) for i in inputs if int(i) >= 0]
        if ins and all(i in derived for i in ins):
            derived.update(int(o) for o in outputs)
    return derived


def casts_integers(op, tensors) -> bool:
    """A CAST of integer (or bool) tensors to float: a mask or positions entering the float
    domain, quantized after it as a graph input is."""
    return op.name == "CAST" and all(tensors[i].dtype not in FLOAT_DTYPES for i in op.inputs if i >= 0)


def sources(ops, tensors, inputs) -> set[int]:
    """Float tensors that enter the graph: its inputs, and the outputs of CASTs of integers."""
    return set(inputs) | {o for op in ops if casts_integers(op, tensors) for o in op.outputs}


def float_island_reason(op, tensors, sources, outputs, derived) -> str | None:
    """Why `op` computes in float inside the graph, or None; the definition is in `inspect`
    (`sources`: the graph's inputs and the outputs of CASTs of integers)."""
    if casts_integers(op, tensors):
        return None
    if op.name == "DEQUANTIZE":
        if op.inputs[0] in derived:
            return "dequantizes a weight at run time"
        if any(o not in outputs for o in op.outputs):
            return "its float output feeds other ops"
        return None
    if op.name == "QUANTIZE":
        source = op.inputs[0]
        if tensors[source].dtype in FLOAT_DTYPES and source not in sources:
            return "quantizes a float tensor computed inside the graph"
        return None
    floats = sorted({tensors[i].dtype for i in (*op.inputs, *op.outputs)
                     if i >= 0 and tensors[i].dtype in FLOAT_DTYPES})
    return f"{'/'.join(floats)} tensors" if floats else None
