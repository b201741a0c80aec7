"""The traced model: ops with module paths, tensor edges, weights tied to parameter paths.

`trace(model, *example_inputs)` turns a Linen module, an NNX module or a plain
function into a `Graph` (see `_trace`, `_program`, `_grouping`, `_patterns`);
`GraphCache` re-traces it for other input shapes with the same op ids.
"""

from odmlq.graph._fold import affine_of, fold_params, folded_bias, folded_operands, folded_ops, operand_values, shift_output, unfold_params
from odmlq.graph._linear import WeightLayout, phase_axes, transposed_by_phases, weight_inputs
from odmlq.graph._graph import MATMUL_KINDS, MAX_CONSTANT_SIZE, MOVES_VALUES, Edge, Graph, Op, Operand
from odmlq.graph._trace import trace
from odmlq.graph._keras import is_keras, keras_input_names, keras_layers, keras_state
from odmlq.graph._loops import loop_edges
from odmlq.graph._program import (STEP_SCOPE, evaluate_replacing, gathered_rows_axes, scattered_row_dims,
                                  scattered_rows_axis)
from odmlq.graph._repeated import repeated_edges
from odmlq.graph._params import (check_finite_params, flat_params, is_nnx_module, param_path, params_tree,
                                 merge_nnx, replace_params, split_nnx)
from odmlq.graph._run import GraphCache, check_inputs, params_for

__all__ = [
    "is_keras", "keras_input_names", "keras_layers", "keras_state",
    "Edge", "Graph", "GraphCache", "affine_of", "fold_params", "folded_bias", "folded_operands", "folded_ops", "shift_output", "unfold_params", "MATMUL_KINDS", "MAX_CONSTANT_SIZE", "MOVES_VALUES", "Op", "Operand", "check_inputs",
    "operand_values", "check_finite_params", "evaluate_replacing", "gathered_rows_axes", "scattered_row_dims", "scattered_rows_axis", "STEP_SCOPE", "loop_edges", "repeated_edges",
    "flat_params", "is_nnx_module", "param_path", "params_for", "params_tree", "merge_nnx", "replace_params", "split_nnx", "trace",
    "WeightLayout", "phase_axes", "transposed_by_phases", "weight_inputs",
]
