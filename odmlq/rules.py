"""Quantization rules: which ops are quantized, and how.

A `Rule` matches ops by module path (a regex, full match) and optionally by op
kind. Rules are tried in order and the first match wins. A rule that matches
an op decides that op's *weights* and its *output* edge (tensor-centric, as
LiteRT is); the op's activation inputs take the spec of their producer, and a
model input takes the spec of its first consumer.

Fields left as None take the defaults in `DEFAULTS` (the one place defaults
live; every backend reads the same resolved values).

Example:
  >>> rules = [Rule('head', skip=True), Rule('.*', weight_qtype='int8', act_qtype='int8')]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import yaml

from odmlq import calibration as calibration_lib
from odmlq.algorithms import GPTQ, Nearest, parse_weight_algorithm
from odmlq.errors import RuleError
from odmlq.granularity import Granularity, PerBlock, PerChannel, PerTensor, granularity_from_dict
from odmlq.qtypes import qtype as lookup_qtype

__all__ = ["FULL_INTEGER_INT8", "INT8", "Rule", "load_rules", "rules_to_dicts", "rules_from_dicts",
           "UnmatchedRuleWarning", "DEFAULTS"]


class UnmatchedRuleWarning(UserWarning):
    """A rule matched no op of the traced model."""


# The single home of every default. `None` in a Rule means "take this".
DEFAULTS: dict[str, Any] = {
    "weight_granularity": PerChannel(),
    "weight_symmetric": True,
    "weight_calibration": calibration_lib.AbsMax(),
    # GPTQ where calibration gives the weight's inputs, to nearest elsewhere
    # (weight-only ptq without calibration).
    "weight_algorithm": GPTQ(required=False),
    "act_granularity": PerTensor(),
    # int8 activations are asymmetric (LiteRT's int8 scheme); int16 activations
    # must be symmetric (LiteRT's 16x8 kernels require zero point 0); fp8 has no
    # zero point.
    "act_symmetric": {"int": False, "int16": True, "float": True},
    # Global min/max: on the digits models it beats averaged per-batch ranges
    # by 20+ dB (DESIGN.md, peers); with headroom where the data's tail says
    # unseen values will pass the extremes seen.
    "act_calibration": calibration_lib.MinMax(headroom=True),
}

_WEIGHT_FIELDS = ("weight_granularity", "weight_symmetric", "weight_calibration", "weight_algorithm")
_ACT_FIELDS = ("act_granularity", "act_symmetric", "act_calibration", "act_dynamic", "float_outputs")


@dataclasses.dataclass(frozen=True)
class Rule:
    """How ops whose module path matches `module_path` are quantized.

    Args:
      module_path: regex, full match against the op's module path
        (``'encoder/layer_3/attention/query'``; ``''`` for top-level ops).
      op: optional op-kind filter, one kind or a tuple (``'dot_general'``,
        ``'conv'``, ``'einsum'``, ``'add'``, ``'relu'``, ...).
      writes_output: match only ops that write a model output, directly or
        through ops that only move values (reshape, transpose, ...): the
        classifier head. ``Rule('.*', writes_output=True, weight_qtype='int8',
        act_qtype='int16')`` before the one-line int8 rule computes the
        outputs in int16x8 (measured: +1.8 to +11.7 dB output SQNR on the
        digits models and a 25M-parameter MLP; one op off XNNPACK);
        `float_outputs` gains as much on them and stays on XNNPACK.
      weight_qtype: qtype of the op's weights (None: weights stay float).
      weight_granularity: `PerTensor()`, `PerChannel()` (default: the op's
        output channels) or `PerBlock(n)` along the contraction axis.
      weight_symmetric: symmetric weights (default True; int weights then use
        the narrow range [-qmax, qmax]).
      weight_calibration: how the weight range is chosen (default `AbsMax()`).
      weight_algorithm: how matmul and convolution weights are rounded to
        their grid: `GPTQ()` rounds against the calibration data's inputs
        (needs `odmlq.calibrate`), `Nearest()` to nearest. Default
        ``GPTQ(required=False)``: GPTQ where calibration data reaches the
        weight, to nearest elsewhere (weight-only ptq without calibration).
      act_qtype: qtype of the op's output edge (None: output stays float).
      act_granularity: `PerTensor()` (default) or `PerChannel(axis)`.
      act_symmetric: default False for int8 (zero point), True for int16.
      act_calibration: how the output range is chosen from calibration data
        (default `MinMax()`). Not allowed with `act_dynamic=True`.
      act_dynamic: quantize the output at run time from its own range instead
        of a calibrated one.
      float_outputs: the model outputs that matched matmuls and convolutions
        with quantized weights write stay float: each reads its int8 input
        edge, quantizes it again per row at run time and writes float from
        its int32 sums (a dynamic-range kernel: LiteRT's hybrid
        FULLY_CONNECTED or CONV_2D, in XNNPACK's partition), so the output's
        own int8 rounding, a step of 1/255 of its range, does not cap the
        model. Where calibration shows that the kernel's second rounding of
        its input would cost more than the int8 output, the output stays
        int8 (`Scales.int8_outputs`). Every other edge keeps `act_qtype`
        (int8 only). `odmlq.INT8` is the one-line int8 rule with it;
        integer-only accelerators and integer interfaces need it off
        (`odmlq.FULL_INTEGER_INT8`).
      skip: keep matched ops in float (no other field may be set).

    Raises:
      RuleError: on a bad regex, an unknown qtype, or contradictory fields.
    """

    module_path: str
    op: str | tuple[str, ...] | None = None
    _: dataclasses.KW_ONLY
    writes_output: bool = False
    weight_qtype: str | None = None
    weight_granularity: Granularity | None = None
    weight_symmetric: bool | None = None
    weight_calibration: Any = None
    weight_algorithm: Any = None
    act_qtype: str | None = None
    act_granularity: Granularity | None = None
    act_symmetric: bool | None = None
    act_calibration: Any = None
    act_dynamic: bool = False
    float_outputs: bool = False
    skip: bool = False

    def __post_init__(self):
        _check_rule(self)
        if isinstance(self.op, list):
            object.__setattr__(self, "op", tuple(self.op))
        for name in ("weight_calibration", "act_calibration"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, calibration_lib.parse_calibration_method(value))
                except Exception as e:  # re-raised as a RuleError that names the field
                    raise RuleError(f"Rule {self.module_path!r}: {name}={value!r}: {e}") from None
        if self.weight_algorithm is not None:
            try:
                object.__setattr__(self, "weight_algorithm", parse_weight_algorithm(self.weight_algorithm))
            except RuleError as e:
                raise RuleError(f"Rule {self.module_path!r}: weight_algorithm: {e}") from None
        _check_histogram_granularity(self)

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(self.module_path)

    def matches(self, module_path: str, op_kind: str, writes_output: bool = False) -> bool:
        """True when this rule applies to an op at `module_path` of kind `op_kind`
        (`writes_output`: the op writes a model output; see the field)."""
        if self.writes_output and not writes_output:
            return False
        if self.op is not None:
            kinds = (self.op,) if isinstance(self.op, str) else self.op
            if op_kind not in kinds:
                return False
        return self.pattern.fullmatch(module_path) is not None

    def resolved(self, field: str) -> Any:
        """The value of `field`, with None replaced by the default."""
        value = getattr(self, field)
        if value is not None:
            return value
        if field == "act_symmetric":
            if self.act_qtype is None:
                return None
            qt = lookup_qtype(self.act_qtype)
            table = DEFAULTS["act_symmetric"]
            return table.get(qt.name, table.get(qt.kind, True))
        return DEFAULTS.get(field)

    def to_dict(self) -> dict:
        """A JSON-ready dict holding only the fields that were set."""
        out: dict[str, Any] = {"module_path": self.module_path}
        for f in dataclasses.fields(self):
            if f.name in ("module_path", "_"):
                continue
            value = getattr(self, f.name)
            if value is None or (f.name in _BOOLEAN_FIELDS and not f.name.endswith("symmetric")
                                 and value is False):
                continue
            if hasattr(value, "to_dict"):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Rule":
        """Inverse of `to_dict`; granularities and calibrations may be dicts or names."""
        if not isinstance(data, dict):
            raise RuleError(f"A rule must be a mapping of fields, got {data!r}.")
        valid = [f.name for f in dataclasses.fields(cls) if f.name != "_"]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise RuleError(f"Unknown rule field(s) {unknown}; valid fields are {valid}.")
        if "module_path" not in data:
            raise RuleError("A rule needs a 'module_path' regex, e.g. module_path: '.*'.")
        data = dict(data)
        for name in ("weight_granularity", "act_granularity"):
            if isinstance(data.get(name), (dict, str)):
                data[name] = granularity_from_dict(data[name])
        return cls(**data)


_BOOLEAN_FIELDS = ("weight_symmetric", "act_symmetric", "act_dynamic", "float_outputs", "skip", "writes_output")


def _check_rule(rule: Rule) -> None:
    where = f"Rule({rule.module_path!r})"
    if not isinstance(rule.module_path, str):
        raise RuleError(f"Rule module_path must be a regex string, got {rule.module_path!r}.")
    for name in _BOOLEAN_FIELDS:
        value = getattr(rule, name)
        if not isinstance(value, bool) and not (value is None and name.endswith("symmetric")):
            raise RuleError(f"{where}: {name}={value!r} must be true or false.")
    try:
        re.compile(rule.module_path)
    except re.error as e:
        raise RuleError(
            f"{where}: module_path is not a valid regex ({e}). Escape literal "
            f"characters, e.g. re.escape('{rule.module_path}')."
        ) from None
    ops = (rule.op,) if isinstance(rule.op, str) else rule.op
    if ops is not None and (not ops or not all(isinstance(o, str) and o for o in ops)):
        raise RuleError(f"{where}: op must be an op kind or a tuple of them, got {rule.op!r}.")
    for name in ("weight_qtype", "act_qtype"):
        value = getattr(rule, name)
        if value is not None:
            try:
                lookup_qtype(value)
            except Exception as e:
                raise RuleError(f"{where}: {name}: {e}") from None
    set_fields = [f for f in _WEIGHT_FIELDS + _ACT_FIELDS + ("weight_qtype", "act_qtype")
                  if getattr(rule, f) not in (None, False)]
    if rule.skip:
        if set_fields:
            raise RuleError(
                f"{where}: skip=True keeps matches in float, but the rule also sets "
                f"{set_fields}. Remove those fields or drop skip."
            )
        return
    for prefix, fields in (("weight", _WEIGHT_FIELDS), ("act", _ACT_FIELDS)):
        if getattr(rule, f"{prefix}_qtype") is None:
            stray = [f for f in fields if getattr(rule, f) not in (None, False)]
            if stray:
                raise RuleError(
                    f"{where} sets {stray} but no {prefix}_qtype; set {prefix}_qtype or remove them."
                )
    if rule.weight_qtype is None and rule.act_qtype is None:
        raise RuleError(
            f"{where} quantizes nothing: set weight_qtype and/or act_qtype "
            "(e.g. weight_qtype='int8', act_qtype='int8'), or skip=True to keep matches in float."
        )
    _check_qtype_fields(rule, where)
    if rule.float_outputs and (rule.act_dynamic or rule.act_qtype is None
                               or lookup_qtype(rule.act_qtype).name != "int8"):
        raise RuleError(
            f"{where}: float_outputs=True computes the model's outputs from int8 edges by dynamic-range "
            f"kernels, but act_qtype={rule.act_qtype!r}" + (" with act_dynamic=True" if rule.act_dynamic else "")
            + "; it needs act_qtype='int8' with calibrated ranges (a dynamic-range model's outputs are float "
            "already, an int16 output is not capped by its rounding).")



def _check_histogram_granularity(rule: Rule) -> None:
    """Histogram methods (Percentile, MSE, Entropy) keep one histogram per tensor."""
    where = f"Rule({rule.module_path!r})"
    for prefix in ("weight", "act"):
        method = getattr(rule, f"{prefix}_calibration")
        granularity = rule.resolved(f"{prefix}_granularity")
        if getattr(method, "needs_histogram", False) and not isinstance(granularity, PerTensor):
            raise RuleError(
                f"{where}: {prefix}_calibration={method!r} reads a histogram, kept per tensor only, but "
                f"{prefix}_granularity is {granularity!r}; use MinMax() or AbsMax(clip_ratio=...) per "
                f"channel or block, or {prefix}_granularity=PerTensor().")

def _check_qtype_fields(rule: Rule, where: str) -> None:
    for prefix in ("weight", "act"):
        name = getattr(rule, f"{prefix}_qtype")
        if name is None:
            continue
        qt = lookup_qtype(name)
        granularity = getattr(rule, f"{prefix}_granularity")
        if granularity is not None and not isinstance(granularity, (PerTensor, PerChannel, PerBlock)):
            raise RuleError(
                f"{where}: {prefix}_granularity={granularity!r}; use PerTensor(), "
                "PerChannel(axis) or PerBlock(size)."
            )
        if getattr(rule, f"{prefix}_symmetric") is False and qt.kind != "int":
            raise RuleError(
                f"{where}: {prefix}_qtype={qt.name!r} has no zero point, so "
                f"{prefix}_symmetric=False is impossible; remove it or use an int qtype."
            )
    if rule.weight_algorithm not in (None, "nearest") and not isinstance(rule.weight_algorithm, Nearest) and (
            rule.weight_qtype is not None and lookup_qtype(rule.weight_qtype).kind != "int"):
        raise RuleError(
            f"{where}: weight_algorithm={rule.weight_algorithm!r} rounds to an integer grid, but "
            f"weight_qtype={rule.weight_qtype!r} is not an integer type; use int8/int4 or drop it.")
    if isinstance(rule.act_granularity, PerBlock):
        raise RuleError(
            f"{where}: act_granularity=PerBlock is for weights; activations take "
            "PerTensor() or PerChannel(axis)."
        )
    if rule.act_dynamic and rule.act_calibration is not None:
        raise RuleError(
            f"{where}: act_dynamic=True takes ranges from the data at run time, so "
            f"act_calibration={rule.act_calibration!r} would be ignored; remove one of them."
        )
    if rule.act_qtype is not None and lookup_qtype(rule.act_qtype).kind == "lut":
        raise RuleError(
            f"{where}: act_qtype='nf4' is a weight-only format; use int8 or int16 for activations."
        )


class _StrictLoader(yaml.SafeLoader):
    """YAML 1.2's booleans: only true and false (any case). YAML 1.1 also
    reads yes/no/on/off/y/n as booleans, so a typo'd value would pass as one;
    here they stay strings, which the boolean fields refuse by name."""


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))


def rules_to_dicts(rules: Sequence[Rule]) -> list[dict]:
    return [r.to_dict() for r in rules]


def rules_from_dicts(data: Sequence[dict], source: str = "rules") -> list[Rule]:
    rules = []
    for index, item in enumerate(data):
        try:
            rules.append(Rule.from_dict(item))
        except RuleError as e:
            raise RuleError(f"{source}: rule {index}: {e}") from None
    return rules


# Every op int8: per-channel int8 weights, int8 activations on every edge, int8
# model outputs (integer-only accelerators; integer interfaces, io_dtype='int8').
FULL_INTEGER_INT8 = (Rule(".*", weight_qtype="int8", act_qtype="int8"),)
# odmlq's default int8 rules: FULL_INTEGER_INT8 with the model outputs that
# matmuls and convolutions write computed into float by dynamic-range kernels
# (`Rule.float_outputs`): the same file size and XNNPACK partitions, without
# the int8 output's rounding (measured: +11.4, +4.0 and +1.5 dB output SQNR on
# the digits MLP, the digits CNN and a 25M-parameter MLP; bench/peers).
INT8 = (Rule(".*", weight_qtype="int8", act_qtype="int8", float_outputs=True),)


def load_rules(path: str | os.PathLike) -> list[Rule]:
    """Reads rules from a YAML or JSON file.

    The file holds a list of rules, or a mapping with a ``rules`` list. Each
    rule is a mapping of `Rule` fields; granularities and calibration methods
    are written as mappings (``{kind: per_block, size: 32}``,
    ``{method: percentile, percentile: 99.9}``) or bare names (``per_channel``,
    ``minmax``).

    Example:
      rules.yaml::

        rules:
          - {module_path: 'head', skip: true}
          - {module_path: '.*', weight_qtype: int8, act_qtype: int8}

      >>> rules = load_rules('rules.yaml')

    Raises:
      RuleError: naming the file and line of a syntax error, or the file and
        rule index of an invalid rule.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise RuleError(f"Cannot read rules file {path!r}: {e.strerror}.") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RuleError(f"{path}:{e.lineno}: JSON syntax error: {e.msg}.") from None
    else:
        try:
            data = yaml.load(text, Loader=_StrictLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f"{mark.line + 1}" if mark is not None else "?"
            problem = getattr(e, "problem", None) or str(e)
            raise RuleError(f"{path}:{line}: YAML syntax error: {problem}.") from None
    if isinstance(data, dict) and "rules" in data:
        data = data["rules"]
    if not isinstance(data, list):
        raise RuleError(
            f"{path}: expected a list of rules (or a mapping with a 'rules' list), "
            f"got {type(data).__name__}."
        )
    return rules_from_dicts(data, source=path)


def warn_unmatched(rules: Sequence[Rule], matched: set[int]) -> list[int]:
    """Warns once per rule that matched nothing; returns their indices."""
    unmatched = [i for i in range(len(rules)) if i not in matched]
    for i in unmatched:
        warnings.warn(
            f"rules[{i}] (module_path={rules[i].module_path!r}"
            + (f", op={rules[i].op!r}" if rules[i].op is not None else "")
            + ") matched no op; check the pattern against the module paths in the plan.",
            UnmatchedRuleWarning,
            stacklevel=3,
        )
    return unmatched
