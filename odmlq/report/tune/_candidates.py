"""The precisions autotune chooses among, one per group of ops (internal).

A `Candidate` is a rule without its module path: autotune writes one rule per
group that takes it. The named candidates cover what the two backends run:

| name | weights | activations | runs on |
|---|---|---|---|
| ``float`` | float | float | both (a float island on LiteRT) |
| ``int16x8`` | int8 per channel | int16 | both (LiteRT's 16x8 kernels) |
| ``int8`` | int8 per channel | int8 | both |
| ``int4`` | int4 per channel | int8 | both |
| ``w8``, ``w4``, ``w2`` | int8 / int4 / int2 per channel | float | XLA (weight-only) |

Which a backend takes is not assumed here: autotune asks the backend's own
check of the plan (`odmlq.litert.check_plan`) which ops a candidate would
leave in float, and never offers a group a candidate that leaves one of its
ops in float.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from odmlq.errors import RuleError
from odmlq.qtypes import qtype as lookup_qtype
from odmlq.rules import Rule

__all__ = ["Candidate", "CANDIDATES", "default_candidates", "parse_candidates"]


@dataclasses.dataclass(frozen=True, init=False)
class Candidate:
    """One precision a group of ops may take: a `Rule`'s fields, without the module path.

    Args:
      name: how tables and results name it.
      **fields: `Rule` fields (``weight_qtype='int4'``, ``act_qtype='int8'``,
        ``weight_granularity=PerBlock(32)``, ``skip=True``, ...).

    Example:
      >>> odmlq.Candidate('w4b32', weight_qtype='int4', weight_granularity=odmlq.PerBlock(32))
    """

    name: str
    fields: tuple[tuple[str, Any], ...]

    def __init__(self, name: str, **fields: Any):
        if not isinstance(name, str) or not name:
            raise RuleError(f"A Candidate needs a name (a non-empty string), got {name!r}.")
        if "module_path" in fields or "op" in fields:
            raise RuleError(f"Candidate {name!r}: module_path and op are chosen by autotune (one rule per "
                            "group of ops); give only the quantization fields.")
        try:
            Rule(".*", **fields)
        except (RuleError, TypeError) as e:
            raise RuleError(f"Candidate {name!r}: {e}") from None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "fields", tuple(sorted(fields.items())))

    def rule(self, module_path: str = ".*", op: tuple[str, ...] | None = None) -> Rule:
        """The rule that gives the ops at `module_path` (a regex; of the kinds
        `op`, default all) this precision."""
        return Rule(module_path, op=op, **dict(self.fields))

    @property
    def is_float(self) -> bool:
        return dict(self.fields).get("skip", False)

    @property
    def weight_bits(self) -> float:
        """Bits each weight element is stored in (8 / values per byte; 32 in float)."""
        name = dict(self.fields).get("weight_qtype")
        if name is None:
            return 32.0
        return 8.0 / lookup_qtype(name).values_per_byte

    @property
    def act_bits(self) -> float:
        """Bits of each output activation (32 in float; 8 for dynamic int8)."""
        fields = dict(self.fields)
        name = fields.get("act_qtype")
        return 32.0 if name is None else float(lookup_qtype(name).bits)

    @property
    def edge_qtype(self) -> str | None:
        """The qtype its ops' output edges hold between ops (None: float, also
        for weight-only and dynamic candidates, whose edges stay float)."""
        fields = dict(self.fields)
        if fields.get("skip") or fields.get("act_dynamic"):
            return None
        return fields.get("act_qtype")

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.fields)
        return f"Candidate({self.name!r}{', ' if inner else ''}{inner})"


CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("float", skip=True),
    Candidate("int16x8", weight_qtype="int8", act_qtype="int16"),
    Candidate("int8", weight_qtype="int8", act_qtype="int8"),
    Candidate("int4", weight_qtype="int4", act_qtype="int8"),
    Candidate("w8", weight_qtype="int8"),
    Candidate("w4", weight_qtype="int4"),
    Candidate("w2", weight_qtype="int2"),
)}


def default_candidates(backend: str, size_target: bool) -> tuple[Candidate, ...]:
    """The candidates tried when none are given.

    With only an accuracy target, the cheap end is int8 (LiteRT: int8, int16x8,
    float; XLA: int8, int8 weight-only, float): int4 would be smaller but not
    faster on either backend's kernels. With a size budget the smaller
    weights join (LiteRT: int4 with int8 activations; XLA: int4 and int2
    weight-only).
    """
    if backend == "xla":
        names = ("w2", "w4", "w8", "float") if size_target else ("int8", "w8", "float")
    else:
        names = ("int4", "int8", "int16x8", "float") if size_target else ("int8", "int16x8", "float")
    return tuple(CANDIDATES[n] for n in names)


def parse_candidates(candidates: Sequence[Candidate | str]) -> tuple[Candidate, ...]:
    """Candidates given by object or by name, checked.

    Raises:
      RuleError: an unknown name, two candidates of one name, or none.
    """
    if isinstance(candidates, (str, Candidate)):
        candidates = (candidates,)
    out = []
    for c in candidates:
        if isinstance(c, str):
            if c not in CANDIDATES:
                raise RuleError(f"Unknown candidate {c!r}; the named ones are {sorted(CANDIDATES)}, "
                                "or pass odmlq.Candidate(name, **rule_fields).")
            c = CANDIDATES[c]
        if not isinstance(c, Candidate):
            raise RuleError(f"A candidate is a name or an odmlq.Candidate, got {c!r}.")
        out.append(c)
    names = [c.name for c in out]
    if not out:
        raise RuleError("autotune needs at least one candidate precision.")
    if len(set(names)) != len(names):
        raise RuleError(f"Candidate names must differ, got {names}.")
    return tuple(out)


def group_pattern(module_path: str) -> str:
    """The regex that matches exactly the ops at `module_path`."""
    return re.escape(module_path)
