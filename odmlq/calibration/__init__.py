"""Calibration: streaming, mergeable statistics per edge and the methods that turn them into ranges.

`calibrate(model, plan, rep_dataset)` observes every statically quantized edge;
methods (`MinMax()`, `Percentile(99.99)`, `MSE()`, ...) are objects; a
`Calibration` saves to .npz without pickle.
"""

from odmlq.calibration._calibrate import calibrate
from odmlq.calibration._calibration import Calibration, channel_key
from odmlq.calibration._gram import Gram
from odmlq.calibration._histogram import HISTOGRAM_BINS
from odmlq.calibration._methods import (
    MSE,
    RMS,
    AbsMax,
    Entropy,
    FixedRange,
    MinMax,
    MovingAverageMinMax,
    Percentile,
    RelativeMSE,
)
from odmlq.calibration._wrapped import (
    CALIBRATION_METHODS,
    MASK_SENTINEL,
    CalibrationMethod,
    Capped,
    Masked,
    calibration_method_from_dict,
    parse_calibration_method,
)
from odmlq.calibration._reuse import calibrated_edges, derivable, needs_calibration, restricted, reusable
from odmlq.calibration._shards import range_of
from odmlq.calibration._statistics import Statistics, compute_range, merge, observe, observe_parts

__all__ = [
    "AbsMax", "CALIBRATION_METHODS", "MASK_SENTINEL", "Calibration", "CalibrationMethod", "Capped", "Entropy", "FixedRange",
    "Gram", "HISTOGRAM_BINS", "MSE", "Masked", "MinMax", "MovingAverageMinMax", "Percentile", "RMS", "RelativeMSE", "Statistics",
    "calibrate", "calibration_method_from_dict", "channel_key", "compute_range", "merge", "observe", "observe_parts",
    "parse_calibration_method", "range_of", "calibrated_edges", "derivable", "needs_calibration", "restricted", "reusable",
]
