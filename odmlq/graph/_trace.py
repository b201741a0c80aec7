"""trace: a model's jaxpr walked into a Graph of ops with module paths.

`jax.make_jaxpr` of the model's apply function gives the equations; the
walker (`_walk`) inlines calls and follows weights to their parameters, and
the grouping (`_grouping`) turns equations into ops and edges.
"""

from __future__ import annotations

import functools
import inspect as pyinspect
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from odmlq.errors import TraceError
from odmlq.graph import _grouping
from odmlq.graph._graph import Graph
from odmlq.graph._canonical import activation_first_matmuls, portable_forms
from odmlq.graph._norms import rewrite_norms
from odmlq.graph._keras import is_keras, keras_function, keras_state
from odmlq.graph._params import is_nnx_module, merge_nnx, nnx_call_scopes, param_path, split_nnx
from odmlq.graph._program import _Program, _TopProgram
from odmlq.graph._walk import _W, _identity, _Walker

__all__ = ["trace"]


def trace(model: Any, *example_inputs: Any, variables: Any = None,
          method: str | Callable | None = None) -> Graph:
    """Traces `model` on `example_inputs` (arrays or jax.ShapeDtypeStruct).

    Args:
      model: a Linen module (pass `variables`, or they are made abstractly
        with `jax.eval_shape(model.init, ...)`), an NNX module, or a function
        ``fn(params, *inputs)`` (pass the params as `variables`).
      *example_inputs: inputs with the shapes and dtypes the model will see.
      variables: Linen variables, or the params of a plain function.
      method: for Linen, the method to apply (default ``__call__``).

    Raises:
      TraceError: naming the call that failed and the input shapes.
    """
    return _trace(model, example_inputs, variables=variables, method=method)



def _trace(model: Any, example_inputs: tuple, *, variables: Any = None, method: Any = None) -> Graph:

    fn, params, framework, model_name = _apply_fn(model, example_inputs, variables, method)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *example_inputs)
    except Exception as e:
        shapes = ", ".join(
            f"{tuple(np.shape(x))} {getattr(x, 'dtype', type(x).__name__)}"
            for x in jax.tree_util.tree_leaves(example_inputs)
        )
        keywords = _keyword_only_hint(model, method, len(example_inputs))
        raise TraceError(
            f"Tracing {model_name} failed with example inputs of shapes [{shapes}]: "
            f"{type(e).__name__}: {e}. " + (f"{keywords}." if keywords else _next_step(e))
        ) from e
    if not jax.tree_util.tree_leaves(out_shape):
        raise TraceError(f"{model_name} returned {jax.tree_util.tree_structure(out_shape)}, no array: there is "
                         "nothing to quantize or export. Return the model's outputs (a method that writes "
                         "its result into a collection: return it, or pass method= of the one that does).")
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path((params, *example_inputs))
    num_params = len(jax.tree_util.tree_leaves(params))
    walker = _Walker()
    env, invars, param_info = {}, [], {}
    for i, (var, (path, leaf)) in enumerate(zip(closed.jaxpr.invars, leaves_with_paths)):
        v = walker.new(var.aval)
        env[var] = v
        invars.append(v)
        if i < num_params:
            name = param_path(path[1:])
            walker.weights[v] = _W((name,), _identity(len(var.aval.shape)))
            param_info[name] = (tuple(var.aval.shape), str(var.aval.dtype))
    steps: list = []
    walker.walk(closed.jaxpr, closed.consts, env, "", steps)
    outvars = [walker.ref(env, o) for o in closed.jaxpr.outvars]
    if walker.random_reads and _draws_random(closed.jaxpr):
        _warn_random(model_name, {_grouping.stack_module_path(p, framework) for p in walker.random_reads})
    walker.drop_unread_casts(steps, outvars)
    rewrite_norms(walker, steps, outvars)
    activation_first_matmuls(walker, steps)
    portable_forms(walker, steps)
    body = _Program(invars, steps, outvars, from_params=walker.steps_from_params(steps, outvars))
    out_tree = jax.tree_util.tree_structure(out_shape)
    graph_parts = _grouping.build(walker, body, num_params, framework)
    return Graph(
        ops=graph_parts.ops, edges=graph_parts.edges, inputs=graph_parts.inputs,
        outputs=graph_parts.outputs, params=param_info, framework=framework,
        model_name=model_name, program=_TopProgram(body, in_tree, out_tree, num_params), method=method,
    )


def _draws_random(jaxpr) -> bool:
    """Whether a random draw reaches the model's outputs: its dead code (the
    samples of a decoder run with teacher forcing, a loss returned into a
    discarded variable) pruned first."""
    from jax._src.interpreters import partial_eval as pe

    live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)

    def draws(j) -> bool:
        for eqn in j.eqns:
            if eqn.primitive.name == "random_bits":
                return True
            for sub in jax.core.jaxprs_in_params(eqn.params):
                if draws(sub):
                    return True
        return False

    return draws(live)


def _warn_random(model_name: str, modules: set[str]) -> None:
    where = ", ".join(f"module {m!r}" if m else "the top level" for m in sorted(modules))
    warnings.warn(
        f"{model_name} draws random numbers from a key fixed when it is traced ({where}): the traced model, "
        "and what odmlq quantizes and exports from it, holds the one draw made then, the same at every "
        "invocation (a sampled latent, dropout with deterministic=False). Where it should sample, pass the "
        "noise as an input (fn(module, x, noise)); for inference, call it in its deterministic mode "
        "(deterministic=True, or a method that does not sample).", UserWarning, stacklevel=4)


def _next_step(error: Exception) -> str:
    """What to do about a model that failed to trace."""
    collection = re.search(r'collection "(\w+)" is immutable', str(error))
    if type(error).__name__ == "ModifyScopeVariableError" and collection:
        name = collection.group(1)
        return (f"The model writes its {name!r} collection as it runs (a decode=True cache; BatchNorm "
                "statistics in training mode). Export a function of the params, the inputs and that "
                f"collection which applies the model with mutable=[{name!r}] and returns the new "
                f"collection, fn(params, x, {name}) -> (out, {name}), with variables=params (state= pairs the "
                "collection returned with the one given back); or run the model in inference mode "
                "(BatchNorm(use_running_average=True)).")
    return "Check that the inputs have the shapes and dtypes the model expects (and that variables match the model)."


def _keyword_only_hint(model: Any, method: Any, n: int) -> str | None:
    """Where the model's call takes keyword-only arguments (Flax's nlp_seq
    tagger: ``__call__(self, *, inputs, train)``) that the example inputs,
    passed positionally, cannot reach: the method= that passes them."""
    if method is not None and not isinstance(method, str):
        return None
    fn = getattr(type(model), method or "__call__", None) if not pyinspect.isfunction(model) else model
    try:
        parameters = list(pyinspect.signature(fn).parameters.values())[1:]  # self, or a function's params
    except (TypeError, ValueError):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword = [p.name for p in parameters if p.kind == p.KEYWORD_ONLY]
    if not keyword or len(positional) >= n or any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return None
    name = f"{type(model).__name__}.{method or '__call__'}" if not pyinspect.isfunction(model) else model.__name__
    taken = [p.name for p in positional] + keyword[:n - len(positional)]
    rest = [p.name for p in parameters if p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name not in taken]
    passed = ", ".join([*taken[:len(positional)], *(f"{t}={t}" for t in taken[len(positional):]),
                        *(f"{r}=..." for r in rest)])
    if pyinspect.isfunction(model):
        return (f"{name} takes keyword-only arguments ({', '.join(keyword)}) and odmlq passes a batch's arrays "
                f"positionally: export lambda params, {', '.join(taken)}: {name}(params, {passed})")
    return (f"{name} takes keyword-only arguments ({', '.join(keyword)}) and odmlq passes a batch's arrays "
            f"positionally: pass method=lambda m, {', '.join(taken)}: m.{method or '__call__'}({passed})"
            .replace("m.__call__(", "m(") + (" (each ... at its inference value)" if rest else ""))


def _apply_fn(model, example_inputs, variables, method):
    import flax.linen as nn

    if isinstance(model, nn.Module):
        name = type(model).__name__
        if variables is None:
            try:
                variables = jax.eval_shape(functools.partial(model.init, method=method), jax.random.key(0),
                                           *example_inputs)
            except Exception as e:
                passed = any(isinstance(x, Mapping) and "params" in x for x in example_inputs)
                hint = ("an example input is a variables dict: pass it as variables=..., not "
                        "among the example inputs" if passed else
                        _keyword_only_hint(model, method, len(example_inputs)) or
                        "check that the example inputs are what its __call__ takes, or pass "
                        "the trained variables as variables=...")
                raise TraceError(
                    f"{name}.init on the {len(example_inputs)} example input(s) failed "
                    f"({type(e).__name__}: {e}); without variables=, a Linen model is "
                    f"initialized from them: {hint}.") from e

        def fn(v, *xs):
            return model.apply(v, *xs, method=method)

        return fn, variables, "linen", name
    if is_nnx_module(model):
        # Random state stays out of the params (a model in eval mode does not
        # read it; a PRNG key is no weight): it is closed over.
        def call(m, *xs):
            if method is None or isinstance(method, str):
                return (m if method is None else getattr(m, method))(*xs)
            return method(m, *xs)  # a function taking the module first, as Linen's method= does

        return (*_nnx_fn(model, call), "nnx", type(model).__name__)
    if is_keras(model):
        return (keras_function(model), keras_state(model) if variables is None else variables, "keras",
                getattr(model, "name", type(model).__name__))
    if callable(model):
        name = getattr(model, "__name__", type(model).__name__)
        if is_nnx_module(variables):  # fn(module, *inputs), as nnx.jit's functions take it
            return (*_nnx_fn(variables, model), "nnx", name)
        if variables is None:
            raise TraceError(f"{name!r} is a plain function; " + _closed_over_hint(model))
        return model, variables, "function", name
    raise TraceError(
        f"Cannot trace {type(model).__name__}: pass a flax.linen Module, a flax.nnx Module, "
        "or a function fn(params, *inputs)."
    )


def _nnx_fn(module: Any, call: Callable) -> tuple[Callable, Any]:
    """``(fn(state, *inputs), state)``: `call(module, *inputs)` on the NNX
    `module` rebuilt around traced state, each submodule's call in a name scope."""
    graphdef, rng_state, state = split_nnx(module)

    def fn(s, *xs):
        m = merge_nnx(graphdef, rng_state, s)
        with nnx_call_scopes(m):
            return call(m, *xs)

    return fn, state


def _closed_over_hint(fn: Any) -> str:
    """What to pass for a plain function given without variables: where it
    reads a module from its closure or its globals, how to pass that module's
    weights (odmlq quantizes parameters it is given, not arrays a function
    holds)."""
    import flax.linen as nn

    code = getattr(fn, "__code__", None)
    seen: dict[str, Any] = {}
    if code is not None:
        cells = getattr(fn, "__closure__", None) or ()
        for var, cell in zip(code.co_freevars, cells):
            try:
                seen[var] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
        globals_ = getattr(fn, "__globals__", {})
        seen.update({n: globals_[n] for n in code.co_names if n in globals_})
    for var, value in seen.items():
        if is_nnx_module(value):
            return (f"it reads the NNX module {var!r} ({type(value).__name__}) it closes over, and odmlq "
                    f"quantizes the weights it is given: take the module as the first argument, "
                    f"fn({var}, *inputs), and pass variables={var}; or pass {var} itself as the model, "
                    f"with method=lambda m, *inputs: ... calling it.")
    for var, value in seen.items():
        if isinstance(value, nn.Module):
            return (f"it calls the Linen module {var!r} ({type(value).__name__}): take its variables as the "
                    f"first argument, fn(params, *inputs) calling {var}.apply(params, ...), and pass "
                    "variables=params.")
    return "pass its params as variables=... (it is called as fn(params, *inputs))."
