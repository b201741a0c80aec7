"""The converter's child process (see `_convert`): StableHLO text in, .tflite out.

Run as a script with one JSON argument; it imports only litert-converter.
On failure it writes a JSON report with the converter's diagnostics and the
ops it left unconverted; a crash is seen by the parent as a signal.
"""

from __future__ import annotations

import json
import re
import sys


def _unlowered(module) -> list[str]:
    """Ops left in a dialect other than TFLite's after conversion, with locations."""
    out = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    name = op.operation.name
                    if not name.startswith(("tfl.", "func.", "arith.", "builtin.")):
                        out.append(f"{op.location}: {name} was not converted to a LiteRT op")
                    walk(op.operation)

    walk(module.operation)
    return out


def _public_function(source: dict, merged: bool) -> str:
    """The source's text, its entry function and module named after the signature when
    several are merged (merge_modules refuses two public functions of one name)."""
    with open(source["path"], encoding="utf-8") as f:
        text = f.read()
    name = source["name"]
    if not merged:
        return text
    text = text.replace("func.func public @main(", f"func.func public @{name}(", 1)
    return re.sub(r"^module @[\w.$-]+", f"module @{name}_module", text, count=1, flags=re.MULTILINE)


def _child(args: dict) -> int:
    """The child process: convert, write the flatbuffer or a JSON report."""
    from litert_converter import converter_api_ext as ext
    from litert_converter.mlir import ir
    from litert_converter.mlir.passmanager import PassManager

    diagnostics: list[str] = []
    context = ir.Context()
    ext.prepare_mlir_context(context)

    def keep(diagnostic) -> bool:
        diagnostics.append(f"{diagnostic.location}: {diagnostic.message}")
        return True  # handled: not printed to stderr as well

    context.attach_diagnostic_handler(keep)
    sources = args["sources"]
    module = None
    try:
        with context:
            modules = [ir.Module.parse(_public_function(source, len(sources) > 1)) for source in sources]
            module = modules[0] if len(modules) == 1 else ext.merge_modules(modules)
            config = ext.ConvertToTFLConfig()
            config.strict_qdq_mode = True
            if args["dynamic_range"]:
                config.qdq_conversion_mode = "DYNAMIC"
            ext.run_convert_to_tfl_passes(module, PassManager(), config)
            if len(sources) == 1:
                ext.set_signature(module.operation, sources[0]["name"], sources[0]["inputs"], sources[0]["outputs"])
            else:
                functions = {str(op.attributes["sym_name"]).strip('"'): op for op in module.body.operations
                             if op.operation.name == "func.func" and "sym_name" in op.attributes}
                for source in sources:
                    ext.set_signature(functions[source["name"]].operation, source["name"], source["inputs"],
                                      source["outputs"])
            data = ext.export_flatbuffer_to_bytes(module.operation)
    except Exception as e:  # the converter raises plain RuntimeErrors / ValueErrors
        if module is not None:
            with context:
                # The export's own message is often empty: name what was not lowered.
                diagnostics.extend(_unlowered(module))
        with open(args["report"], "w", encoding="utf-8") as f:
            json.dump({"error": f"{type(e).__name__}: {e}", "diagnostics": list(dict.fromkeys(diagnostics))}, f)
        return 1
    with open(args["target"], "wb") as f:
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))
