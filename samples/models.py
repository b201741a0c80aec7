"""Sample models: an MLP and a small CNN for 8x8 digits, in Linen and in NNX.

The Linen and NNX versions have the same module names and the same layers, so
their plans are identical op for op and edge for edge.

Each builder returns ``(model, example_inputs, variables)``, the form the
``odmlq plan`` command takes from a ``module:function`` argument
(``variables`` is None for NNX, whose modules hold their own state).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

DIGITS_SHAPE = (8, 8, 1)  # scikit-learn's digits: 8x8 grey images
NUM_CLASSES = 10


class LinenMLP(nn.Module):
    hidden: tuple[int, ...] = (512, 256)

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"dense{i + 1}")(x))
        return nn.Dense(NUM_CLASSES, name="head")(x)


class NnxMLP(nnx.Module):
    def __init__(self, hidden: tuple[int, ...] = (512, 256), *, rngs: nnx.Rngs):
        sizes = (DIGITS_SHAPE[0] * DIGITS_SHAPE[1], *hidden)
        for i in range(len(hidden)):
            setattr(self, f"dense{i + 1}", nnx.Linear(sizes[i], sizes[i + 1], rngs=rngs))
        self.num_hidden = len(hidden)
        self.head = nnx.Linear(sizes[-1], NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for i in range(self.num_hidden):
            x = nnx.relu(getattr(self, f"dense{i + 1}")(x))
        return self.head(x)


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3), name="conv1")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(32, (3, 3), name="conv2")(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64, name="dense1")(x))
        return nn.Dense(NUM_CLASSES, name="head")(x)


class NnxCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
        self.head = nnx.Linear(64, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        x = nnx.relu(self.conv2(x))
        x = x.reshape((x.shape[0], -1))
        x = nnx.relu(self.dense1(x))
        return self.head(x)


def _example(batch: int = 1) -> jax.Array:
    return jnp.zeros((batch, *DIGITS_SHAPE), jnp.float32)


def mlp(seed: int = 0):
    """Linen MLP 64-512-256-10 with initialized variables."""
    model, x = LinenMLP(), _example()
    return model, (x,), model.init(jax.random.key(seed), x)


def mlp_nnx(seed: int = 0):
    """NNX twin of `mlp`."""
    return NnxMLP(rngs=nnx.Rngs(seed)), (_example(),), None


def cnn(seed: int = 0):
    """Linen CNN: conv 16, avg pool, conv 32, dense 64, dense 10."""
    model, x = LinenCNN(), _example()
    return model, (x,), model.init(jax.random.key(seed), x)


def cnn_nnx(seed: int = 0):
    """NNX twin of `cnn`."""
    return NnxCNN(rngs=nnx.Rngs(seed)), (_example(),), None


SAMPLES = {"mlp": mlp, "mlp_nnx": mlp_nnx, "cnn": cnn, "cnn_nnx": cnn_nnx}
