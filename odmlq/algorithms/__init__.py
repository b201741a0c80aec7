"""Weight algorithms: how a weight's values are rounded to its grid.

Without one a weight is rounded to nearest. `GPTQ()` rounds it against the
calibration data's inputs (see `_gptq`). An algorithm is chosen per rule
(`Rule(..., weight_algorithm=GPTQ())`), written into the Plan with the
weight's spec, and applied where scales are computed, so every backend reads
the same integers.
"""

from odmlq.algorithms._gptq import GPTQ, gptq_round
from odmlq.algorithms._parse import WEIGHT_ALGORITHMS, parse_weight_algorithm

__all__ = ["GPTQ", "WEIGHT_ALGORITHMS", "gptq_round", "parse_weight_algorithm"]
