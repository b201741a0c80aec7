"""Tests for the digits data, training and accuracy used by the samples."""

import time

import jax
import numpy as np
import pytest
from flax import nnx
from sklearn.datasets import load_digits

from samples import digits as digits_lib
from samples.models import SAMPLES

# The step cap makes training deterministic wherever compiling and 300 steps
# fit in the 10 s budget (about 3 s on 2 CPU cores); the clock only guards
# slow machines.
_SECONDS = 10.0
_MAX_STEPS = 300

# Floors are the lowest test accuracy measured minus a margin. Measured over
# seeds 0-2 on 2 cores: at 300 steps MLPs 0.965-0.980, CNNs 0.972-0.985; even
# at 50 steps (a machine 6x slower) MLPs 0.913-0.943, CNNs 0.943-0.948.
_ACCURACY_FLOOR = {"mlp": 0.88, "mlp_nnx": 0.88, "cnn": 0.90, "cnn_nnx": 0.90}


@pytest.fixture(scope="module")
def digits():
    return digits_lib.load_digits_splits()


@pytest.fixture(scope="module", params=sorted(SAMPLES))
def trained(request, digits):
    model, variables = digits_lib.train(
        request.param, digits, seconds=_SECONDS, max_steps=_MAX_STEPS)
    return request.param, model, variables


def _splits(d):
    return {"train": (d.x_train, d.y_train),
            "calibration": (d.x_calibration, d.y_calibration),
            "test": (d.x_test, d.y_test)}


def _sorted_rows(x, y):
    """Image-and-label rows in a canonical order, to compare multisets."""
    rows = np.concatenate([x.reshape(len(x), -1), y[:, None].astype(np.float32)], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


def test_splits_have_shapes_dtypes_and_ranges(digits):
    sizes = {}
    for name, (x, y) in _splits(digits).items():
        assert x.dtype == np.float32, name
        assert y.dtype == np.int32, name
        assert x.shape == (len(y), 8, 8, 1), name
        assert 0.0 <= x.min() and x.max() <= 1.0, (name, x.min(), x.max())
        # Stratified: every class is in every split.
        np.testing.assert_array_equal(np.unique(y), np.arange(10), err_msg=name)
        sizes[name] = len(y)
    total = sum(sizes.values())
    assert total == 1797
    np.testing.assert_allclose(
        [sizes["train"] / total, sizes["calibration"] / total, sizes["test"] / total],
        [0.6, 0.1, 0.3], atol=0.01)


def test_splits_partition_the_dataset(digits):
    # Together the splits hold each (image, label) of the dataset exactly as
    # often as the dataset does, so no image is in two splits.
    full = load_digits()
    x_full = (full.images / 16.0).astype(np.float32)
    xs, ys = zip(*_splits(digits).values())
    np.testing.assert_array_equal(
        _sorted_rows(np.concatenate(xs), np.concatenate(ys)),
        _sorted_rows(x_full, full.target.astype(np.int32)))


def test_splits_are_deterministic_per_seed(digits):
    again = digits_lib.load_digits_splits(seed=0)
    for (name, (x, y)), (x2, y2) in zip(_splits(digits).items(), _splits(again).values()):
        np.testing.assert_array_equal(x, x2, err_msg=name)
        np.testing.assert_array_equal(y, y2, err_msg=name)
    other = digits_lib.load_digits_splits(seed=1)
    assert not np.array_equal(digits.y_test, other.y_test)


def test_batches_cover_in_order_with_a_short_last_batch(digits):
    x = digits.x_calibration
    result = digits_lib.batches(x, 32)
    assert [len(b) for b in result] == [32] * (len(x) // 32) + [len(x) % 32]
    np.testing.assert_array_equal(np.concatenate(result), x)


def test_batches_rejects_a_nonpositive_size(digits):
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        digits_lib.batches(digits.x_calibration, 0)


def test_train_rejects_an_unknown_model(digits):
    with pytest.raises(ValueError, match=r"Unknown model 'resnet'; choose one of \['cnn'"):
        digits_lib.train("resnet", digits, max_steps=1)


def test_trained_model_beats_the_floor(trained, digits):
    name, model, variables = trained
    if name.endswith("_nnx"):
        assert variables is None  # NNX modules are trained in place
    got = digits_lib.accuracy(model, variables, digits.x_test, digits.y_test)
    assert got >= _ACCURACY_FLOOR[name], f"{name}: test accuracy {got:.4f}"


def test_accuracy_matches_a_direct_argmax(trained, digits):
    name, model, variables = trained
    x, y = digits.x_test, digits.y_test
    logits = model(x) if variables is None else model.apply(variables, x)
    predictions = np.argmax(np.asarray(logits), axis=-1)
    # Same predictions and count, so the fractions are equal exactly.
    np.testing.assert_equal(digits_lib.accuracy(model, variables, x, y),
                            float(np.mean(predictions == y)))
    np.testing.assert_equal(digits_lib.accuracy(model, variables, x, predictions), 1.0)
    np.testing.assert_equal(digits_lib.accuracy(model, variables, x, (predictions + 1) % 10), 0.0)


@pytest.mark.parametrize("name", ["mlp", "mlp_nnx"])
def test_train_is_reproducible_with_a_step_cap(name, digits):
    def weights():
        model, variables = digits_lib.train(name, digits, seconds=60.0, max_steps=20)
        return jax.tree.leaves(variables if variables is not None else nnx.state(model))

    for a, b in zip(weights(), weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_train_keeps_to_its_time_budget(digits):
    # The budget includes compiling the step (about 2.5 s here) and the clock
    # is read every 20 steps (about 15 ms of steps): 1 s of slack covers the
    # last window and returning the weights.
    start = time.perf_counter()
    digits_lib.train("cnn", digits, seconds=4.0, max_steps=10**7)
    assert time.perf_counter() - start < 5.0
