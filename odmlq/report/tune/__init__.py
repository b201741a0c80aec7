"""Automatic precision: the rules that meet an accuracy floor or a size budget.

`autotune(model, variables, rep_dataset, target=TuneTarget(...))` measures
what each group of ops (one module path) costs the outputs at each candidate
precision, searches for the cheapest configuration that meets the target,
measures every configuration it proposes, and returns ordinary rules.
"""

from odmlq.report.tune._autotune import autotune
from odmlq.report.tune._model import rules_for
from odmlq.report.tune._candidates import CANDIDATES, Candidate, default_candidates, parse_candidates
from odmlq.report.tune._result import Trial, TuneResult
from odmlq.report.tune._target import Measured, TuneTarget

__all__ = ["CANDIDATES", "Candidate", "Measured", "Trial", "TuneResult", "TuneTarget", "autotune",
           "default_candidates", "parse_candidates", "rules_for"]
