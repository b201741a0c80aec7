"""Conversion: a JAX function to .tflite bytes with litert-converter.

No TensorFlow: the function is lowered to StableHLO, parsed in the
converter's MLIR context, converted with strict QDQ semantics and exported as
a flatbuffer with a ``serving_default`` signature.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from odmlq.errors import OdmlqError


class ConversionError(OdmlqError, RuntimeError):
    """litert-converter failed; the message keeps its diagnostics.

    `locations` holds the scope paths (``op id/primitive``) the diagnostics name.
    """

    locations: tuple[str, ...] = ()


def convert(fn: Callable, example_inputs: Sequence[Any], *, input_names: Sequence[str],
            output_names: Sequence[str], dynamic_range: bool = False) -> bytes:
    """Lowers `fn` on `example_inputs` and converts it to a flatbuffer.

    Raises:
      ConversionError: with the converter's diagnostic and the op ids named in it.
    """
    from litert_converter import converter_api_ext as ext
    from litert_converter.mlir import ir
    from litert_converter.mlir.passmanager import PassManager

    # debug_info keeps named-scope locations: tensor names then carry op ids.
    text = jax.jit(fn).lower(*example_inputs).as_text(debug_info=True)
    context = ir.Context()
    ext.prepare_mlir_context(context)
    diagnostics: list[str] = []

    def keep(diagnostic) -> bool:
        diagnostics.append(f"{diagnostic.location}: {diagnostic.message}")
        return True  # handled: do not print it to stderr as well

    context.attach_diagnostic_handler(keep)
    try:
        with context:
            module = ir.Module.parse(text)
            config = ext.ConvertToTFLConfig()
            config.strict_qdq_mode = True
            if dynamic_range:
                config.qdq_conversion_mode = "DYNAMIC"
            ext.run_convert_to_tfl_passes(module, PassManager(), config)
            ext.set_signature(module.operation, "serving_default", list(input_names),
                              list(output_names))
            try:
                return ext.export_flatbuffer_to_bytes(module.operation)
            except Exception:
                # The export's own message is often empty: name what was not lowered.
                diagnostics.extend(_unlowered(module))
                raise
    except Exception as e:  # the converter raises plain RuntimeErrors / ValueErrors
        detail = "\n".join(dict.fromkeys(diagnostics)) or str(e)
        error = ConversionError(f"litert-converter failed: {type(e).__name__}: {e}\n{detail}")
        error.locations = tuple(re.findall(r"jit\([^)]*\)/([^\"]+)\"", detail))
        raise error from e


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
