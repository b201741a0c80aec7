import os

# Tests run on the CPU with deterministic, quiet JAX.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
