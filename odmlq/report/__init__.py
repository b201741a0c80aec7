"""Reports: float, simulate, XLA, LiteRT and device runs lined up by plan edge.

Sits above both backends: `compare(model, plan, scales, *inputs, xla=..., tflite=...)`
measures every edge of every run against float and ranks them; reports save
as JSON, self-contained HTML and Model Explorer node data.
"""

from odmlq.report._advice import Advice, Measured
from odmlq.report._device import device_report
from odmlq.report._islands import FloatOp
from odmlq.report._metrics import EdgeMetrics, ErrorHistogram, edge_metrics
from odmlq.litert.device import NOT_ODMLQ
from odmlq.report._report import RUNS, EdgeReport, Report, ReportError, compare
from odmlq.report._weights import COLLAPSED_FRACTION, OUTLIER_RATIO, WeightRange

__all__ = ["Advice", "EdgeMetrics", "EdgeReport", "ErrorHistogram", "FloatOp", "Measured", "NOT_ODMLQ",
           "COLLAPSED_FRACTION", "OUTLIER_RATIO", "RUNS", "Report", "ReportError", "WeightRange", "compare",
           "device_report", "edge_metrics"]
