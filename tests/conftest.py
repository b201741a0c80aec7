import os

# Tests run on the CPU with deterministic, quiet JAX.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keras 3 reads its backend once, at its first import: odmlq traces JAX.
os.environ.setdefault("KERAS_BACKEND", "jax")
