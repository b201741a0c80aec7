"""`print(summary)`: a `ModelSummary` as aligned text tables (internal;
`odmlq.litert.format_summary` is public through `inspect`)."""

from __future__ import annotations

from odmlq.plan import text_table as table

__all__ = ["format_summary"]

_SCHEMA_WORDS = {"static": "integer activations", "dynamic": "dynamic range", "weight_only": "weight-only",
                 "float": "float"}


def format_summary(summary) -> str:
    """Renders a summary as aligned text tables (what `print(summary)` shows).

    Example:
      >>> print(format_summary(inspect('model.tflite')))
    """
    t = summary.tensors
    sigs = "; ".join(f"signature {k!r} ({', '.join(v['inputs'])} -> {', '.join(v['outputs'])})"
                     for k, v in summary.signatures.items()) or "no signature"
    out = [f"LiteRT model ({_SCHEMA_WORDS[summary.schema]}): {len(summary.ops)} ops, {len(t)} tensors, "
           f"{summary.file_bytes} bytes; {sigs}", "", "Ops"]
    rows = [[str(op.index), op.name, ", ".join(_describe(t, i) for i in op.inputs),
             ", ".join(_describe(t, i) for i in op.outputs), _module(op.module_path)]
            for op in summary.ops]
    out.append(table(["#", "op", "inputs", "outputs", "module"], rows))
    out += ["", "Tensors"]
    rows = [[str(x.index), _short_name(x.name), x.dtype, "x".join(map(str, x.shape)) or "scalar",
             _quantization(x) or "-", str(x.nbytes) if x.is_constant else "-"] for x in t]
    out.append(table(["#", "name", "dtype", "shape", "quantization", "bytes"], rows))
    out += ["", "Op histogram",
            table(["op", "count"], [[k, str(v)] for k, v in summary.op_histogram.items()])]
    if summary.schema == "static":
        out += _section("Float islands", ["#", "op", "module", "why"], [
            [str(op.index), op.name, _module(op.module_path), summary.why_float(op) or ""]
            for op in summary.float_islands])
        out += _section("Dynamic-range kernels (input quantized at run time, output float)",
                        ["#", "op", "module"], [[str(op.index), op.name, _module(op.module_path)]
                                                for op in summary.dynamic_kernels])
    else:
        out += ["", f"Float islands: none counted: a {_SCHEMA_WORDS[summary.schema]} model computes in float "
                    "by design"]
    out += _section("Weights requantized, dequantized or transposed at run time", ["#", "op", "module", "weight"], [
        [str(op.index), op.name, _module(op.module_path), _describe(t, op.inputs[0])]
        for op in summary.weight_work_at_run_time])
    islands = f"; {len(summary.float_islands)} float islands" if summary.schema == "static" else ""
    out += ["", f"Weights: {summary.weight_bytes} bytes in {sum(x.is_constant for x in t)} constant "
                f"tensors{islands}; file: {summary.file_bytes} bytes"]
    return "\n".join(line.rstrip() for line in out)


def _section(title: str, headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["", f"{title} ({len(rows)}): " + ("" if rows else "none")] + (
        [table(headers, rows)] if rows else [])


def _quantization(x) -> str:
    if not x.scales:
        return ""
    distinct = set(x.zero_points)  # an omitted zero point means 0 to the interpreter
    zp = str(distinct.pop()) if len(distinct) == 1 else f"[{len(x.zero_points)}]" if distinct else "0"
    if x.block_size is not None:
        return f"s=[{len(x.scales)}] blocks of {x.block_size} zp=0"
    if len(x.scales) == 1:
        return f"s={x.scales[0]:.6g} zp={zp}"
    return f"s=[{len(x.scales)}] axis={x.quantized_dimension} zp={zp}"


def _describe(tensors, index: int) -> str:
    if index < 0:
        return "-"
    x = tensors[index]
    return " ".join(filter(None, [f"t{index}", x.dtype, _quantization(x)]))


def _short_name(name: str) -> str:
    first, *rest = name.split(";")
    return f"{first} (+{len(rest)} fused)" if rest else first


def _module(path: str | None) -> str:
    return "-" if path is None else (path or "''")
