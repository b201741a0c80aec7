"""Weight algorithms: how a weight's values are rounded to its grid.

`Nearest()` rounds each weight to the nearest value of its grid; `GPTQ()`
rounds it against the calibration data's inputs (see `_gptq`), odmlq's
default where calibration data reaches the weight. An algorithm is chosen per rule
(`Rule(..., weight_algorithm=GPTQ())`), written into the Plan with the
weight's spec, and applied where scales are computed, so every backend reads
the same integers.

`odmlq.awq` (a module of its own: it plans and calibrates) moves
per-input-channel scales from quantized matmuls' weights into the ops before
them, as float parameters computing the same function.
"""

from odmlq.algorithms._gptq import GPTQ, gptq_round
from odmlq.algorithms._parse import WEIGHT_ALGORITHMS, Nearest, parse_weight_algorithm

__all__ = ["GPTQ", "Nearest", "WEIGHT_ALGORITHMS", "gptq_round", "parse_weight_algorithm"]
