"""Keras 3 models (JAX backend) as odmlq models (internal).

A Keras model is run as the pure function its `stateless_call` gives:
``fn(state, *inputs)`` where `state` maps each variable's path
(``'sequential/conv1/kernel'``) to its value, in inference mode
(``training=False``). Keras names a JAX scope after every layer it calls, so
the traced ops carry the layers' names as module paths (``conv1``,
``transformer_layer_0/self_attention/query``): rules match Keras layer names
as they match Flax module paths.

Keras is never imported here unless the model is a Keras object.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from odmlq.errors import TraceError


def is_keras(model: Any) -> bool:
    """Whether `model` is a Keras 3 model or layer (built-in or user-defined class)."""
    return hasattr(model, "stateless_call") and any(
        (klass.__module__ or "").split(".")[0] == "keras" for klass in type(model).__mro__)


def _check(model: Any) -> None:
    import keras

    if keras.backend.backend() != "jax":
        raise TraceError(
            f"{type(model).__name__} is a Keras model on the {keras.backend.backend()!r} backend; odmlq "
            "traces JAX: set KERAS_BACKEND=jax before keras is first imported.")
    quantized = [f"{layer.name} ({layer.quantization_mode})" for layer in keras_layers(model)
                 if getattr(layer, "quantization_mode", None)]
    if quantized:
        raise TraceError(
            f"Keras model {model.name!r} has layers quantized by model.quantize(): {', '.join(quantized[:8])}"
            + (f" and {len(quantized) - 8} more" if len(quantized) > 8 else "") + ". Read it with "
            "odmlq.keras_quantized(model) (int8 Dense layers: a float twin and the rules that quantize it as "
            "Keras did), or pass the float model (before model.quantize) with your own rules.")
    if not getattr(model, "built", True) or not model.variables:
        raise TraceError(
            f"Keras model {getattr(model, 'name', type(model).__name__)!r} has no variables yet: build "
            "it (call it once on an example batch, or give it a keras.Input) before quantizing.")


def keras_layers(model: Any) -> list:
    """Every layer inside `model`, nested ones included."""
    flatten = getattr(model, "_flatten_layers", None)
    return list(flatten(include_self=False)) if callable(flatten) else list(getattr(model, "layers", []))


def keras_state(model: Any) -> dict[str, Any]:
    """Each variable's value by its path, the params a Keras model is traced with.

    Raises:
      TraceError: the backend is not JAX, the model is not built, or two
        variables share a path.
    """
    _check(model)
    paths = [v.path for v in model.variables]
    repeated = [p for p, n in collections.Counter(paths).items() if n > 1]
    if repeated:
        raise TraceError(f"Keras model {model.name!r}: variables {repeated} share a path; give the layers "
                         "unique names (name=...).")
    return {v.path: v.value for v in model.variables}


def keras_input_names(model: Any) -> list[str] | None:
    """The names of a functional model's inputs, in the order odmlq takes them:
    a dict of inputs (keras-hub backbones: token_ids, padding_mask, ...) by
    its keys, a list by its Input layers' names; None for one input or a
    subclassed model."""
    try:
        inputs = model.input
    except (AttributeError, ValueError):  # subclassed, or never called on symbolic inputs
        return None
    if isinstance(inputs, dict):
        return list(inputs)
    if isinstance(inputs, (list, tuple)) and len(inputs) > 1:
        return [getattr(x, "name", f"input_{i}") for i, x in enumerate(inputs)]
    return None


def keras_function(model: Any) -> Callable:
    """``fn(state, *inputs)``: the model's inference forward pass, pure.

    A model whose inputs are a dict takes its arrays positionally, in the
    order of `keras_input_names` (which also name the .tflite's inputs);
    several inputs are passed as the list a functional model takes.
    """
    _check(model)
    trainable = [v.path for v in model.trainable_variables]
    non_trainable = [v.path for v in model.non_trainable_variables]
    names = keras_input_names(model)
    by_name = isinstance(getattr(model, "input", None), dict) if names else False

    def fn(state, *inputs):
        if by_name:
            if len(inputs) != len(names):
                raise TraceError(f"Keras model {model.name!r} takes {len(names)} inputs, in this order: "
                                 f"{names}; got {len(inputs)}. Pass one array per name.")
            args = dict(zip(names, inputs))
        else:
            args = inputs[0] if len(inputs) == 1 else list(inputs)
        outputs, _ = model.stateless_call([state[p] for p in trainable], [state[p] for p in non_trainable],
                                          args, training=False)
        return outputs

    return fn
