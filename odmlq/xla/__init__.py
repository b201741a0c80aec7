"""The XLA backend: quantized params, integer matmuls and convolutions, save/load.

  >>> qmodel = odmlq.ptq(model, rules, variables, calibration, example_inputs=(x,))
  >>> qmodel(x)
"""

from odmlq.xla._lowering import Lowering
from odmlq.xla._params import quantize_params
from odmlq.xla._save import load_params, save_params
from odmlq.xla.ptq import TARGET, QuantizedModel, ptq

__all__ = ["Lowering", "QuantizedModel", "TARGET", "load_params", "ptq", "quantize_params", "save_params"]
