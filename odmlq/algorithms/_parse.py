"""Weight algorithms from their objects, dicts (a Plan's JSON) or names."""

from __future__ import annotations

from typing import Any

import dataclasses
from typing import ClassVar

from odmlq.algorithms._gptq import GPTQ
from odmlq.errors import RuleError


@dataclasses.dataclass(frozen=True)
class Nearest:
    """Round every weight to the nearest value of its grid (no data needed).

    Example:
      >>> rules = [odmlq.Rule('.*', weight_qtype='int8', weight_algorithm=odmlq.Nearest())]
    """

    name: ClassVar[str] = "nearest"

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.name}


# name -> class; the closed set of weight algorithms.
WEIGHT_ALGORITHMS: dict[str, type] = {GPTQ.name: GPTQ, Nearest.name: Nearest}


def parse_weight_algorithm(value: Any) -> Any:
    """An algorithm object from itself, its dict or its name.

    Raises:
      RuleError: an unknown name, or a field it does not have.

    Example:
      >>> parse_weight_algorithm({'algorithm': 'gptq', 'damping': 0.1})
      GPTQ(damping=0.1, act_order=True, block_size=128)
    """
    if isinstance(value, tuple(WEIGHT_ALGORITHMS.values())):
        return value
    if isinstance(value, str):
        value = {"algorithm": value}
    if not isinstance(value, dict) or value.get("algorithm") not in WEIGHT_ALGORITHMS:
        raise RuleError(
            f"A weight algorithm is an algorithm object (e.g. odmlq.GPTQ()), its dict or one of "
            f"the names {sorted(WEIGHT_ALGORITHMS)}; got {value!r}.")
    fields = {k: v for k, v in value.items() if k != "algorithm"}
    cls = WEIGHT_ALGORITHMS[value["algorithm"]]
    try:
        return cls(**fields)
    except TypeError as e:
        raise RuleError(f"Weight algorithm {value!r}: {e}.") from None
