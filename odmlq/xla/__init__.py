"""The XLA backend: quantized params, integer matmuls and convolutions, save/load.

  >>> qmodel = odmlq.ptq(model, rules, variables, calibration, example_inputs=(x,))
  >>> qmodel(x)
"""

from odmlq.xla._lowering import Lowering
from odmlq.xla._params import quantize_params
from odmlq.xla._save import load_params, save_params
from odmlq.xla.ptq import QuantizedModel, ptq

__all__ = ["ptq", "QuantizedModel", "Lowering", "quantize_params", "save_params", "load_params"]
