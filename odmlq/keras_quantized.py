"""Keras' own int8 layers read back as a float model and odmlq rules.

A Keras 3 model quantized by ``model.quantize('int8')`` computes each Dense
layer as: the input quantized per row at run time (``127 / max|x|``, round
half to even, clip to +-127), an int8 x int8 -> int32 matmul with the stored
int8 kernel, and one rescale by ``kernel_scale`` and the row's scale. The
same numbers are odmlq's plan for the float layer whose kernel is
``kernel / kernel_scale``: int8 weights per output channel, symmetric,
rounded to nearest (the stored integers come back exactly: each channel's
largest one is +-127), and int8 activations quantized per row at run time,
symmetric. `keras_quantized` builds that float model and those rules.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from odmlq.algorithms import Nearest
from odmlq.errors import TraceError
from odmlq.granularity import PerChannel
from odmlq.graph import is_keras, keras_layers
from odmlq.rules import Rule

__all__ = ["keras_quantized"]


def keras_quantized(model: Any) -> tuple[Any, list[Rule]]:
    """The float twin of a Keras model quantized by ``model.quantize('int8')``
    and the rules that quantize it as Keras did.

    Returns:
      ``(float_model, rules)``: a Keras model with the same layers, names and
      variable paths in float (each int8 Dense's kernel ``kernel /
      kernel_scale``), and one rule per int8 layer (the other ops stay in
      float, as they are in the Keras model). ``odmlq.ptq(float_model, rules, ...)`` computes what the
      Keras model computes (the same integers; the outputs within float32
      rounding of the rescale).

    Raises:
      TraceError: not a Keras model, no int8 layer, or a layer quantized
        otherwise than int8 Dense (named).

    Example:
      >>> model.quantize('int8')
      >>> float_model, rules = odmlq.keras_quantized(model)
      >>> qmodel = odmlq.ptq(float_model, rules, example_inputs=(x,))
    """
    import keras

    if not is_keras(model):
        raise TraceError(f"keras_quantized takes a Keras model; got {type(model).__name__}.")
    layers = [layer for layer in keras_layers(model) if getattr(layer, "quantization_mode", None)]
    if not layers:
        raise TraceError(f"Keras model {model.name!r} has no layer quantized by model.quantize(); pass it "
                         "to odmlq as it is, with your rules.")
    other = [f"{layer.name} ({type(layer).__name__}, {layer.quantization_mode})" for layer in layers
             if layer.quantization_mode != "int8" or type(layer) is not keras.layers.Dense]
    if other:
        raise TraceError(f"Keras model {model.name!r}: odmlq reads Keras' int8 Dense layers; these are "
                         f"quantized otherwise: {', '.join(other)}. Quantize the float model with odmlq rules.")
    names = {layer.name for layer in layers}

    def float_layer(layer):
        config = layer.get_config()
        if layer.name in names:
            config["dtype"] = "float32"
        return layer.__class__.from_config(config)

    twin = keras.models.clone_model(model, clone_function=float_layer)
    for layer in layers:
        stored = {v.name: np.asarray(v.value) for v in layer.variables}
        kernel = stored["kernel"].astype(np.float32) / stored["kernel_scale"].astype(np.float32)
        target = twin.get_layer(layer.name)
        target.kernel.assign(kernel)
        if layer.use_bias:
            target.bias.assign(stored["bias"])
    rules = [Rule(re.escape(name), weight_qtype="int8", weight_granularity=PerChannel(), weight_algorithm=Nearest(),
                  act_qtype="int8", act_dynamic=True, act_symmetric=True, act_granularity=PerChannel(0))
             for name in sorted(names)]
    return twin, rules
