"""converters.sharded_checkpoint: Hugging Face's sharded safetensors layout, written and read tensor by tensor."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from converters._checkpoint import CheckpointError, ModelFilesError
from converters.sharded_checkpoint import INDEX, ShardedCheckpoint, write_sharded


def _tensors():
    rng = np.random.default_rng(0)
    return [(f"layer_{i}.kernel", rng.normal(size=(16, 8)).astype(ml_dtypes.bfloat16)) for i in range(5)]


def test_tensors_split_over_files_read_back_whole_and_by_slice(tmp_path):
    tensors = _tensors()
    files = write_sharded(tmp_path, iter(tensors), max_file_bytes=2 * 16 * 8 * 2, metadata={"a": "b"})
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"] == {"a": "b"} and index["weight_map"]["layer_4.kernel"] == files[2]
    checkpoint = ShardedCheckpoint(tmp_path)
    assert checkpoint.names == [name for name, _ in tensors]
    for name, value in tensors:
        assert checkpoint.shape(name) == (16, 8)
        assert np.array_equal(checkpoint.read(name), value)
        assert np.array_equal(checkpoint.read(name, (slice(4, 9), slice(2, 3))), value[4:9, 2:3])
    placed = checkpoint.array("layer_2.kernel", jax.sharding.SingleDeviceSharding(jax.devices()[0]), np.float32)
    assert placed.dtype == np.float32 and np.array_equal(np.asarray(placed), tensors[2][1].astype(np.float32))


def test_a_name_given_twice_leaves_no_checkpoint(tmp_path):
    tensors = _tensors()
    with pytest.raises(CheckpointError, match="'layer_0.kernel' twice"):
        write_sharded(tmp_path, iter(tensors + tensors[:1]), max_file_bytes=16 * 8 * 2)
    assert os.listdir(tmp_path) == []


def test_missing_index_file_and_tensor_are_named(tmp_path):
    with pytest.raises(ModelFilesError, match="No model.safetensors.index.json"):
        ShardedCheckpoint(tmp_path)
    files = write_sharded(tmp_path, iter(_tensors()), max_file_bytes=16 * 8 * 2)
    checkpoint = ShardedCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        checkpoint.read("nope")
    os.unlink(tmp_path / files[1])
    with pytest.raises(ModelFilesError, match=f"not there: {files[1]}"):
        ShardedCheckpoint(tmp_path)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.int8])
def test_slices_read_in_many_chunks_equal_numpy_slicing(tmp_path, dtype, monkeypatch):
    """A slice is read from the file in chunks of whole rows (no memory map): with
    chunks of 3 rows, every slice a sharding can ask for equals numpy's."""
    import converters.sharded_checkpoint as sharded

    rng = np.random.default_rng(1)
    value = (rng.normal(size=(11, 6, 5)) * 50).astype(dtype)
    write_sharded(tmp_path, iter([("a.b", value[:2]), ("w", value)]), max_file_bytes=1 << 20)
    monkeypatch.setattr(sharded, "_CHUNK_BYTES", 3 * 6 * 5 * np.dtype(dtype).itemsize)
    checkpoint = ShardedCheckpoint(tmp_path)
    for index in [(slice(None),), (slice(2, 10), slice(1, 4)), (slice(None), slice(None), slice(3, 5)),
                  (slice(10, 11),), (slice(0, 11), slice(0, 6), slice(0, 5))]:
        got = checkpoint.read("w", index)
        assert got.dtype == value.dtype and np.array_equal(got, value[index]), index
