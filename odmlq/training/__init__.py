"""Training modes: quantization-aware training (`qat`) on the Plan's fake quantization, and low-rank
adapters over a base stored quantized (`lora`: LoRA and QLoRA)."""

from odmlq.training._lora import LoRA, Placement, lora
from odmlq.training._qat import QAT, qat

__all__ = ["LoRA", "Placement", "QAT", "qat", "lora"]
