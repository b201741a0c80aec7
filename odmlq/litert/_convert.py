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
    """litert-converter failed; the message keeps its diagnostic."""


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
            return ext.export_flatbuffer_to_bytes(module.operation)
    except Exception as e:  # the converter raises plain RuntimeErrors / MLIRErrors
        ops = sorted(set(re.findall(r"jit\([^)]*\)/([\w./-]+?)/[\w.]+\"", str(e))))
        where = f" (at ops {', '.join(ops)})" if ops else ""
        raise ConversionError(
            f"litert-converter failed{where}: {type(e).__name__}: {e}"
        ) from e
