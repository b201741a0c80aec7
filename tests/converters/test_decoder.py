"""converters/decoder.py: the decoder's safetensors checkpoint written and read back, and refused when it does not fit."""

import jax
import numpy as np
import pytest

from converters._checkpoint import CheckpointError, ModelFilesError
from converters.decoder import CONFIG_KEY, load_decoder, save_decoder
from samples.decoder_model import Decoder, DecoderConfig

CONFIG = DecoderConfig(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, mlp_hidden=48, cache_length=16)


def _variables(config=CONFIG):
    return Decoder(config).init(jax.random.key(0), np.zeros((1, 4), np.int32))


def test_a_saved_decoder_reads_back_bit_for_bit(tmp_path):
    variables = _variables()
    save_decoder(tmp_path / "d.safetensors", variables, CONFIG)
    model, loaded, config = load_decoder(tmp_path / "d.safetensors")
    assert config == CONFIG and model.config == CONFIG
    jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, variables))
    tokens = np.arange(8, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(model.apply(loaded, tokens)),
                                  np.asarray(Decoder(CONFIG).apply(variables, tokens)))


def test_variables_of_another_config_are_refused_and_nothing_is_written(tmp_path):
    other = DecoderConfig(hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, mlp_hidden=64, cache_length=16)
    with pytest.raises(CheckpointError, match=r"shape mismatches \(6\): layer_0.down.kernel is \(64, 32\)"):
        save_decoder(tmp_path / "d.safetensors", _variables(other), CONFIG)
    assert list(tmp_path.iterdir()) == []


def test_files_that_are_not_this_decoder_are_refused(tmp_path):
    from safetensors.numpy import save_file

    with pytest.raises(ModelFilesError, match="No decoder checkpoint at .*python -m samples.decoder_lm"):
        load_decoder(tmp_path / "missing.safetensors")
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="has no 'decoder_config' metadata"):
        load_decoder(tmp_path / "plain.safetensors")
    save_decoder(tmp_path / "d.safetensors", _variables(), CONFIG)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "final_norm.scale"}
        metadata = f.metadata()
    save_file(tensors, str(tmp_path / "cut.safetensors"), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): final_norm.scale"):
        load_decoder(tmp_path / "cut.safetensors")
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={CONFIG_KEY: '{"heads": 3, "kv_heads": 2}'})
    with pytest.raises(CheckpointError, match="is not a decoder config"):
        load_decoder(tmp_path / "bad.safetensors")
