"""Training modes: quantization-aware training (`qat`) on the Plan's fake quantization."""

from odmlq.training._qat import QAT, qat

__all__ = ["QAT", "qat"]
