"""Real data and trained weights for the sample models: scikit-learn's digits.

The 1,797 8x8 digit images ship with scikit-learn, so no network is needed.
They are split once into train, calibration and test sets. The calibration
set is the representative data for quantization; it is kept apart from the
test set so that accuracy after quantization is measured on unseen images.

Example:
    >>> digits = load_digits_splits()
    >>> model, variables = train("cnn", digits, seconds=5.0)
    >>> accuracy(model, variables, digits.x_test, digits.y_test)  # about 0.98
    >>> representative = batches(digits.x_calibration, 32)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from samples.models import DIGITS_SHAPE, SAMPLES

# Pixel values in scikit-learn's digits are integers 0..16.
_PIXEL_MAX = 16.0
_TEST_FRACTION = 0.3
_CALIBRATION_FRACTION = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Digits:
    """Digits split into train, calibration and test sets.

    Images are float32 shaped (N, 8, 8, 1) with values in [0, 1]; labels are
    int32 in 0..9. Each image is in exactly one split.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_calibration: np.ndarray
    y_calibration: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_splits(seed: int = 0) -> Digits:
    """Loads scikit-learn's digits split about 60/10/30, stratified by label.

    Args:
      seed: Seed of the split; the same seed gives the same split.

    Returns:
      The three splits as numpy arrays.
    """
    data = load_digits()
    x = (data.images / _PIXEL_MAX).astype(np.float32).reshape((-1, *DIGITS_SHAPE))
    y = data.target.astype(np.int32)
    x_rest, x_test, y_rest, y_test = train_test_split(
        x, y, test_size=_TEST_FRACTION, stratify=y, random_state=seed)
    # The calibration fraction is of the whole set, so rescale it to the rest.
    x_train, x_calibration, y_train, y_calibration = train_test_split(
        x_rest, y_rest, test_size=_CALIBRATION_FRACTION / (1 - _TEST_FRACTION),
        stratify=y_rest, random_state=seed)
    return Digits(x_train=x_train, y_train=y_train, x_calibration=x_calibration,
                  y_calibration=y_calibration, x_test=x_test, y_test=y_test)


def batches(x: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Cuts `x` into consecutive batches, the representative-dataset form.

    The last batch is smaller when `batch_size` does not divide len(x), so
    every example is seen exactly once.

    Args:
      x: Examples, batch dimension first.
      batch_size: Examples per batch, at least 1.

    Returns:
      The batches, in order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    return [x[i:i + batch_size] for i in range(0, len(x), batch_size)]


def _split_apply(model_name: str, seed: int) -> tuple[Any, Any, Callable, Callable]:
    """Builds a sample as (model, params, apply(params, x), write_back(params))."""
    if model_name not in SAMPLES:
        raise ValueError(f"Unknown model {model_name!r}; choose one of {sorted(SAMPLES)}.")
    model, _, variables = SAMPLES[model_name](seed)
    if variables is not None:
        return model, variables, model.apply, lambda params: params
    # NNX: train the Param state functionally, then write it back into the
    # module; a pure jitted step avoids nnx.jit's per-call graph traversal.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(params, x):
        return nnx.merge(graphdef, params, rest)(x)

    def write_back(params):
        nnx.update(model, params)
        return None

    return model, params, apply, write_back


def _shuffled_batches(n: int, batch_size: int,
                      rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Yields index batches forever, reshuffling every epoch."""
    # Full batches only, so the train step compiles for one shape.
    num_batches = max(n // batch_size, 1)
    while True:
        order = rng.permutation(n)
        for b in range(num_batches):
            yield order[b * batch_size:(b + 1) * batch_size]


# Steps between looks at the clock (each look waits for the queued steps).
_CLOCK_STEPS = 20


def train(model_name: str, digits: Digits, *, seconds: float = 5.0, seed: int = 0,
          max_steps: int = 2000, min_steps: int = 300, batch_size: int = 64,
          learning_rate: float = 1e-2) -> tuple[Any, Any]:
    """Trains a sample model on the train split with Adam.

    Training stops after `seconds` of wall time or `max_steps` steps, whichever
    comes first, but not before `min_steps`. The clock starts when this is
    called, so compiling the train step counts against the budget; on a busy
    machine compiling alone can take it, and the floor keeps the model trained
    (one step left the CNN at 0.18 accuracy). Because of
    the clock, the number of steps (and so the weights) can differ from run to
    run; pass a large `seconds` and a `max_steps` for reproducible weights.

    Args:
      model_name: One of 'mlp', 'cnn', 'mlp_nnx', 'cnn_nnx'.
      digits: The splits from `load_digits_splits`.
      seconds: Wall-time budget for training.
      seed: Seed of the initial weights and of the batch order.
      max_steps: Most steps to take.
      min_steps: Fewest steps to take, whatever the clock says.
      batch_size: Examples per step.
      learning_rate: Adam's learning rate.

    Returns:
      `(model, variables)` for Linen; `(model, None)` for NNX, whose module is
      trained in place.
    """
    deadline = time.perf_counter() + seconds
    model, params, apply, write_back = _split_apply(model_name, seed)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(params):
            logits = apply(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # numpy indexing is cheaper per step than a gather dispatched to JAX.
    x_train, y_train = digits.x_train, digits.y_train
    indices = _shuffled_batches(len(x_train), batch_size, np.random.default_rng(seed))
    for index_of_step in range(max_steps):
        index = next(indices)
        params, opt_state = step(params, opt_state, x_train[index], y_train[index])
        # Steps are dispatched ahead of the device; waiting for every
        # `_CLOCK_STEPS`-th keeps the clock honest without stalling each one.
        if index_of_step % _CLOCK_STEPS == 0:
            jax.block_until_ready(params)
            if index_of_step >= min_steps and time.perf_counter() >= deadline:
                break
    jax.block_until_ready(params)
    return model, write_back(params)


def accuracy(model: Any, variables: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of `x` classified as `y`.

    Args:
      model: A Linen module, or an NNX module when `variables` is None.
      variables: Linen variables, or None for NNX.
      x: Images shaped (N, 8, 8, 1).
      y: Integer labels shaped (N,).

    Returns:
      The accuracy in [0, 1].
    """
    logits = model(x) if variables is None else model.apply(variables, x)
    return float(np.mean(np.argmax(np.asarray(logits), axis=-1) == np.asarray(y)))


if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(description="Train every sample model on the digits and print its "
                                                  "test accuracy.")
    _parser.add_argument("--seconds", type=float, default=5.0, help="training time budget per model (default 5)")
    _args = _parser.parse_args()
    _digits = load_digits_splits()
    print(f"train {len(_digits.y_train)}, calibration {len(_digits.y_calibration)}, "
          f"test {len(_digits.y_test)}")
    for _name in SAMPLES:
        _start = time.perf_counter()
        _model, _variables = train(_name, _digits, seconds=_args.seconds)
        _seconds = time.perf_counter() - _start
        print(f"{_name:8s} test accuracy {accuracy(_model, _variables, _digits.x_test, _digits.y_test):.4f}"
              f"  ({_seconds:.1f} s wall including compilation)")
