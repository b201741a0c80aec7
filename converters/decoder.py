"""The decoder's checkpoint (`samples.decoder_model`): a safetensors file, its config in the metadata.

`save_decoder(path, variables, config)` writes every parameter by its dotted
Flax path (``layer_0.attention.query.kernel``), float32, with the
`DecoderConfig` as JSON under the metadata key ``decoder_config``; the file
is written whole or not at all (a temporary file renamed over `path`).
`load_decoder(path)` reads it back into ``(Decoder, variables, config)``,
checking every name and shape against the model the config builds.

Example:
  >>> save_decoder('decoder.safetensors', variables, config)
  >>> model, variables, config = load_decoder('decoder.safetensors')
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from converters._checkpoint import CheckpointError, ModelFilesError, check_names, nest
from samples.decoder_model import Decoder, DecoderConfig

__all__ = ["CONFIG_KEY", "load_decoder", "save_decoder"]

CONFIG_KEY = "decoder_config"


def _named(variables: Any) -> dict[str, Any]:
    """Dotted parameter name -> leaf."""
    leaves = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    return {".".join(str(k.key) for k in path): leaf for path, leaf in leaves}


def _expected(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    shapes = jax.eval_shape(Decoder(config).init, jax.random.key(0), np.zeros((1, 1), np.int32))
    return {name: tuple(shape.shape) for name, shape in _named(shapes).items()}


def save_decoder(path: str | os.PathLike, variables: Any, config: DecoderConfig) -> None:
    """Writes `variables` (``{'params': ...}`` of ``Decoder(config)``) to `path`.

    Raises:
      CheckpointError: `variables` do not fit ``Decoder(config)`` (all names listed).
    """
    from safetensors.numpy import save_file

    tensors = {name: np.asarray(leaf, np.float32) for name, leaf in _named(variables).items()}
    check_names(tensors, _expected(config), source="save_decoder's variables argument", model=f"Decoder({config})",
                fix="Save the variables of a Decoder built with this config.")
    path = os.fspath(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                         dir=os.path.dirname(os.path.abspath(path)))
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata={CONFIG_KEY: json.dumps(config.to_dict())})
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def load_decoder(path: str | os.PathLike) -> tuple[Decoder, dict, DecoderConfig]:
    """Reads a file `save_decoder` wrote.

    Returns:
      ``(model, variables, config)``: the `Decoder`, ``{'params': ...}`` (numpy
      float32) and its `DecoderConfig`.

    Raises:
      ModelFilesError: there is no file at `path`.
      CheckpointError: the file has no decoder config, or its tensors do not
        fit the model the config builds (every missing, unexpected and
        misshapen name listed).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ModelFilesError(f"No decoder checkpoint at {str(path)!r}; train one with "
                              "`python -m samples.decoder_lm --out DIR` (it writes DIR/decoder.safetensors).")
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
        if CONFIG_KEY not in metadata:
            raise CheckpointError(f"{str(path)!r} has no {CONFIG_KEY!r} metadata: it was not written by "
                                  "converters.decoder.save_decoder.")
        try:
            config = DecoderConfig(**json.loads(metadata[CONFIG_KEY]))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{str(path)!r}: its {CONFIG_KEY!r} metadata is not a decoder config ({e}).") \
                from None
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    check_names(tensors, _expected(config), source=repr(str(path)), model=f"Decoder({config})",
                fix="Was it written for another decoder config?")
    params: dict = {}
    for name, value in tensors.items():
        nest(params, tuple(name.split(".")), np.asarray(value, np.float32))
    return Decoder(config), {"params": params}, config
