"""Converters from pretrained checkpoints to Flax models odmlq can quantize.

- `converters.minilm`: sentence-transformers all-MiniLM-L6-v2 (safetensors) to
  `samples.minilm_model.MiniLM`.
- `converters.efficientnet_lite`: the published EfficientNet-Lite0 (a PyTorch
  legacy checkpoint) to `samples.efficientnet_model.EfficientNetLite0`.
- `converters.torch_checkpoint`: the allow-list reader of PyTorch checkpoints
  (tensors only; never runs code from the file).
"""
