"""odmlq diff: a device dump against the host interpreter."""

import subprocess
import sys

import numpy as np
import pytest

import odmlq
from odmlq import cli
from samples.models import cnn


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, (x,), variables = cnn()
    data = np.random.default_rng(0).random((16, 8, 8, 1), np.float32)
    path = tmp_path_factory.mktemp("m") / "m.tflite"
    odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                        [data[:8], data[8:]], path, variables=variables, verify=False)
    inputs = path.parent / "in.npz"
    np.savez(inputs, x=data[:1])
    return path, inputs


def _dump(exported, tmp_path):
    """The device side, run as the user would run it: the standalone script."""
    path, inputs = exported
    dump = tmp_path / "dump.npz"
    subprocess.run([sys.executable, "samples/dump_tensors.py", str(path), str(inputs), str(dump)],
                   check=True, capture_output=True)
    return dump


def test_identical_device_agrees(exported, tmp_path, capsys):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    assert cli.main(["diff", str(path), "--inputs", str(inputs), "--device-tensors", str(dump),
                     "--min-sqnr", "30"]) == 0
    out = capsys.readouterr().out
    assert "device and host agree within 1 LSB on every tensor" in out and "outputs: inf dB" in out


def test_device_that_parts_is_flagged_and_gated(exported, tmp_path, capsys):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    with np.load(dump) as f:
        tensors = {k: f[k].copy() for k in f.files}
    name = next(k for k in tensors if "conv2/relu" in k and tensors[k].dtype == np.int8)
    tensors[name] = np.clip(tensors[name].astype(np.int32) + 5, -128, 127).astype(np.int8)
    missing = next(k for k in tensors if "reshape" in k)
    del tensors[missing]
    output = next(k for k in tensors if k.endswith("_output"))
    tensors[output] = tensors[output] * 1.3  # the error reaches the output: about 10 dB
    np.savez(dump, **tensors)
    assert cli.main(["diff", str(path), "--inputs", str(inputs), "--device-tensors", str(dump),
                     "--min-sqnr", "30"]) == 3
    out = capsys.readouterr()
    assert f"device parts from host at: {name}" in out.out
    assert "missing from the dump (1)" in out.out
    assert "under --min-sqnr 30" in out.err


def test_min_sqnr_passes_when_met(exported, tmp_path):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    assert cli.main(["diff", str(path), "--inputs", str(inputs), "--device-tensors", str(dump),
                     "--min-sqnr", "1000"]) == 0  # identical: infinite SQNR
