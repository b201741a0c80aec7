"""Converters from pretrained checkpoints to Flax models odmlq can quantize.

- `converters.minilm`: sentence-transformers all-MiniLM-L6-v2 (safetensors) to
  `samples.minilm_model.MiniLM`.
"""
