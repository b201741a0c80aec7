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


# Kernels with a dynamic-range (hybrid) form: a float input, a quantized
# constant filter (input 1), a float output; the input is quantized at run time.
_HYBRID_KERNELS = frozenset({"FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D", "BATCH_MATMUL"})


def is_dynamic_kernel(op, tensors, derived) -> bool:
    """A dynamic-range kernel: its float input quantized at run time against a
    quantized constant filter (not a DEQUANTIZE's output), its output float."""
    if op.name not in _HYBRID_KERNELS or len(op.inputs) < 2:
        return False
    data, weight = op.inputs[0], op.inputs[1]
    return (data >= 0 and weight >= 0 and tensors[data].dtype in FLOAT_DTYPES and weight in derived
            and tensors[weight].dtype not in FLOAT_DTYPES and bool(tensors[weight].scales)
            and all(o >= 0 and tensors[o].dtype in FLOAT_DTYPES for o in op.outputs))


def dynamic_kernel_inputs(ops, tensors, derived) -> frozenset[int]:
    """Float tensors only dynamic-range kernels read (the DEQUANTIZE of an int8
    edge before a classifier head computed into float outputs)."""
    readers: dict[int, list] = {}
    for op in ops:
        for i in op.inputs:
            readers.setdefault(i, []).append(op)
    return frozenset(t for t, ops_reading in readers.items()
                     if t >= 0 and all(is_dynamic_kernel(o, tensors, derived) and o.inputs[0] == t
                                       for o in ops_reading))


# Ops that only move values: after a dynamic-range kernel's float output (a
# classifier's logits transposed to NCHW), they carry it to the graph's outputs.
_MOVING = frozenset({"RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS"})


def dynamic_kernel_outputs(ops, tensors, derived) -> frozenset[int]:
    """Tensors a dynamic-range kernel writes, and those that only value-moving ops
    make from them."""
    out: set[int] = set()
    for op in ops:  # in execution order
        if is_dynamic_kernel(op, tensors, derived) or (op.name in _MOVING and op.inputs and op.inputs[0] in out):
            out.update(op.outputs)
    return frozenset(out)


def float_island_reason(op, tensors, sources, outputs, derived, kernel_inputs=frozenset(),
                        kernel_outputs=frozenset()) -> str | None:
    """Why `op` computes in float inside the graph, or None; the definition is in `inspect`
    (`sources`: the graph's inputs and the outputs of CASTs of integers; `kernel_inputs`:
    `dynamic_kernel_inputs`; `kernel_outputs`: `dynamic_kernel_outputs`)."""
    if casts_integers(op, tensors) or is_dynamic_kernel(op, tensors, derived):
        return None
    if op.name in _MOVING and op.inputs and op.inputs[0] in kernel_outputs:
        return None
    if op.name == "DEQUANTIZE":
        if op.inputs[0] in derived:
            return "dequantizes a weight at run time"
        if any(o not in outputs and o not in kernel_inputs for o in op.outputs):
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
