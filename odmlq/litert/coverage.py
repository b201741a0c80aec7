"""Op coverage as data: what each op kind odmlq recognises becomes on LiteRT,
per schema, from the op table (`odmlq.litert.spec`). `docs/OPS.md` is this
module's `markdown()` (a test keeps it so); `odmlq ops` prints it.

Schemas:
- int8 / int16x8 (full integer): the op's integer kernel, or why it is
  refused before any work (the export then needs the op kept in float and
  ``allow_float_ops=True``);
- dynamic-range: matmuls and convolutions read int8 weights and quantize
  their inputs at run time; every other op runs in float;
- weight-only: weights stored quantized, every op computes in float.
"""

from __future__ import annotations

from odmlq.constraints import FixedOutput, SameAsInput, SharedWithInputs
from odmlq.graph import MATMUL_KINDS
from odmlq.litert.spec import OP_SPEC, WITHOUT_KERNEL

__all__ = ["markdown", "rows"]

_SCHEMAS = (("int8", "int8"), ("int16", "int16x8"))


def _output(spec) -> str:
    if isinstance(spec.output, SameAsInput):
        return "input's scale"
    if isinstance(spec.output, SharedWithInputs):
        return "shared with inputs"
    if isinstance(spec.output, FixedOutput):
        return "fixed: " + ", ".join(f"{q} {s.scale:.6g}/{s.zero_point}" for q, s in spec.output.scales.items())
    return "calibrated"


def rows() -> list[dict[str, str]]:
    """One row per op kind: LiteRT op, per-schema support, output scale, tolerance, notes."""
    out = []
    for kind in sorted(OP_SPEC):
        spec = OP_SPEC[kind]
        row = {"kind": kind, "litert": spec.becomes}
        for qtype, name in _SCHEMAS:
            if qtype in spec.schemas:
                row[name] = "integer"
            else:
                row[name] = "refused: " + (spec.refused or {}).get(qtype, f"no {qtype} kernel")
        row["dynamic-range"] = ("int8 weights, inputs quantized at run time" if kind in MATMUL_KINDS
                                else "int8 table, float output" if kind == "gather" else "float")
        row["weight-only"] = ("quantized weights, float compute" if kind in MATMUL_KINDS
                              else "quantized table, float output" if kind == "gather" else "float")
        row["output scale"] = _output(spec)
        tolerance = spec.tolerance_lsb or {}
        per_element = spec.tolerance_lsb_per_element or {}
        row["tolerance"] = ", ".join(
            f"{'int16x8' if q == 'int16' else q} {tolerance.get(q, 1.0):g} LSB"
            + (f" or {per_element[q]:g} per element of the last axis, if more" if q in per_element else "")
            for q, _ in _SCHEMAS if q in spec.schemas)
        row["notes"] = spec.note
        out.append(row)
    for kind in sorted(WITHOUT_KERNEL):
        reason = "refused: " + WITHOUT_KERNEL[kind]
        out.append({"kind": kind, "litert": "(float)", "int8": reason, "int16x8": reason,
                    "dynamic-range": "float", "weight-only": "float", "output scale": "-",
                    "tolerance": "-", "notes": ""})
    return out


def markdown() -> str:
    """The docs/OPS.md page."""
    columns = ["kind", "litert", "int8", "int16x8", "dynamic-range", "weight-only", "output scale",
               "tolerance", "notes"]
    lines = [
        "# Op coverage on LiteRT",
        "",
        "Generated from odmlq's op table (`odmlq/litert/spec.py`) by `odmlq ops`; do not edit.",
        "",
        "Every op kind odmlq recognises in a traced model, and what it becomes in each LiteRT",
        "schema. \"refused\" ops are named before any work (the plan check) with the option to",
        "keep them in float (`Rule(..., skip=True)` and `allow_float_ops=True`); each refusal is",
        "tested by forcing the op through export, where it fails to convert, stays float or",
        "misses simulate. \"tolerance\" is what verification allows against simulate per",
        "element (approximating kernels get more than one rounding step). Op kinds not listed",
        "are refused as having no integer kernel.",
        "",
        "Rewritten while tracing, the values unchanged, so they appear here as other kinds:",
        "`x ** 2` is `square`; `-x` is `mul` by -1 (LiteRT keeps NEG float); a boolean `xor` is",
        "`ne` (XOR has no LiteRT op); `jax.nn.silu` is its `logistic` and `mul`; a broadcast that",
        "copies an activation at most 16 times (`jnp.repeat` of grouped-query attention's key",
        "and value heads) is a `broadcast_in_dim` adding axes of size 1 and a `concatenate` of",
        "the copies, and one that copies it more (a decoder's new key selected into every",
        "position of its cache) that `broadcast_in_dim` and a `mul` by ones shaped as the copied",
        "axes (LiteRT keeps BROADCAST_TO float); `jnp.stack` of activations is each with an axis of size 1 added and a",
        "`concatenate` along it; `jax.nn.hard_sigmoid` is its `add`, `relu6` and `div`, and",
        "`jax.nn.hard_swish` those and a `mul` (XNNPACK runs no int8 HARD_SWISH, LiteRT has no",
        "int16 one); a gather of an activation at constant positions that repeat in order (a",
        "nearest resize by an integer factor) is a `reshape`, the copies and a `reshape`, and at",
        "consecutive positions a `slice`; a float `div` by a constant array (rotary timescales) is",
        "a `mul` by its reciprocal (within float32 rounding); a matmul whose weight is its left",
        "operand (a `jnp.einsum` listing the kernel's axes first) is the activation times the",
        "weight and a `transpose`.",
        "",
        "A loop (`lax.scan`: `nn.RNN` over an LSTM or GRU cell, `nn.scan`) runs its body's ops",
        "once per step in the file, every step at the body's scales; its per-step outputs are",
        "joined by a CONCATENATION in int8, and by PADs and ADDs in int16 (litert-converter",
        "0.5.0 takes no int16 operand for CONCATENATION). Each step's ops are named by step, and",
        "verified step by step, fed that step's LiteRT tensors; where the converter leaves a step",
        "without an edge's tensor, what follows is verified from the loop's inputs, allowed its",
        "body's largest kernel tolerance once per step. Layers stacked by `nn.scan` (weights with",
        "a layer axis, the first) are one tensor per layer with that layer's per-channel scales;",
        "a carry started from another edge (the residual stream) shares one grid with what the",
        "body writes to it, and its start is requantized onto it. Block scales are refused there.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows():
        lines.append("| " + " | ".join(row[c].replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines) + "\n"
