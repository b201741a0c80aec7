"""The Plan: a traced graph with a decision for every op, weight and edge.

`plan(model, rules, *example_inputs, target=...)` applies the rules (first
match wins) and resolves the target's scale constraints into the edges, so
every consumer (simulate, the XLA and LiteRT backends, the report) reads one
resolved Plan and none re-decides.
"""

from odmlq.plan._conversions import Conversion, conversion_name, input_conversion_scales, input_conversions, op_qtype
from odmlq.plan._passes import dynamic_kernel_inputs
from odmlq.plan._plan import EdgePlan, OpPlan, Plan, WeightPlan, check_rules, plan, plan_graph
from odmlq.plan._spec import QuantSpec
from odmlq.plan._table import named_list, table as text_table

__all__ = [
    "Conversion", "EdgePlan", "OpPlan", "Plan", "QuantSpec", "WeightPlan", "check_rules",
    "conversion_name", "dynamic_kernel_inputs", "input_conversion_scales", "input_conversions", "op_qtype", "plan",
    "named_list", "plan_graph", "text_table",
]
