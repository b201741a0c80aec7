"""odmlq diff: a device dump against the host interpreter (and, with --model, against float and simulate)."""

import json
import subprocess
import sys

import numpy as np
import pytest

import odmlq
from odmlq import cli
from odmlq.litert.device import check_model_inputs, dump_tensors, produced_by_odmlq
from odmlq.report import NOT_ODMLQ
from samples.models import cnn


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model, (x,), variables = cnn()
    data = np.random.default_rng(0).random((16, 8, 8, 1), np.float32)
    path = tmp_path_factory.mktemp("m") / "m.tflite"
    result = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                                 [data[:8], data[8:]], path, variables=variables, verify=False)
    result.calibration.save(path.parent / "calibration.npz")
    inputs = path.parent / "in.npz"
    np.savez(inputs, x=data[:1])
    return path, inputs


@pytest.fixture(scope="module")
def plain_float(tmp_path_factory):
    """A float .tflite made by litert-converter from the model, without odmlq's annotations."""
    from odmlq.litert import _convert

    model, (x,), variables = cnn()
    tflite = _convert.convert(lambda x: model.apply(variables, x), (x,), input_names=["x"],
                              output_names=["output_0"])
    path = tmp_path_factory.mktemp("f") / "float.tflite"
    path.write_bytes(tflite)
    inputs = path.parent / "in.npz"
    np.savez(inputs, x=np.random.default_rng(1).random((1, 8, 8, 1), np.float32))
    dump = path.parent / "dump.npz"
    np.savez(dump, **dump_tensors(tflite, [np.load(inputs)["x"]]))
    return path, inputs, dump


def _dump(exported, tmp_path):
    """The device side, run as the user would run it: the standalone script."""
    path, inputs = exported
    dump = tmp_path / "dump.npz"
    subprocess.run([sys.executable, "samples/dump_tensors.py", str(path), str(inputs), str(dump)],
                   check=True, capture_output=True)
    return dump


def _diff(path, inputs, dump, *more):
    return cli.main(["diff", str(path), "--inputs", str(inputs), "--device-tensors", str(dump), *more])


def test_identical_device_agrees(exported, tmp_path, capsys):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    assert _diff(path, inputs, dump, "--min-sqnr", "30") == 0
    out = capsys.readouterr().out
    assert "device and host agree within 1 LSB on every tensor" in out and "outputs: inf dB" in out
    assert NOT_ODMLQ not in out


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
    assert _diff(path, inputs, dump, "--min-sqnr", "30") == 3
    out = capsys.readouterr()
    assert f"device parts from host at: {name}" in out.out
    assert "missing from the dump (1)" in out.out
    assert "under --min-sqnr 30" in out.err


def test_min_sqnr_passes_when_met(exported, tmp_path):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    assert _diff(path, inputs, dump, "--min-sqnr", "1000") == 0  # identical: infinite SQNR


def test_with_the_model_every_edge_is_compared_with_float_and_simulate(exported, tmp_path, capsys):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    calibration = str(path.parent / "calibration.npz")
    assert _diff(path, inputs, dump, "--model", "samples.models:cnn", "--calibration", calibration) == 0
    out = capsys.readouterr().out
    assert "simulate dB" in out and "device dB" in out and "device-sim LSB" in out
    assert "output_0 (device)" in out
    assert _diff(path, inputs, dump, "--model", "samples.models:cnn", "--calibration", calibration,
                 "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"] == ["local", "simulate", "litert", "device"] and not data["unmapped_tensors"]
    quantized = [e for e in data["edges"] if e["spec"] != "float"]
    assert len(quantized) == 7 and all(e["runs"]["device"]["simulate_lsb"] <= 1.0 for e in quantized)
    assert any("device vs host interpreter: device and host agree" in n for n in data["notes"])


def test_the_model_needs_the_calibration_it_was_exported_with(exported, tmp_path, capsys):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    assert _diff(path, inputs, dump, "--model", "samples.models:cnn") == 1
    assert "needs --calibration C.npz" in capsys.readouterr().err
    assert _diff(path, inputs, dump, "--calibration", "c.npz") == 1
    assert "add --model" in capsys.readouterr().err


def test_a_tflite_odmlq_did_not_make_is_compared_at_its_outputs(plain_float, exported, capsys):
    path, inputs, dump = plain_float
    assert not produced_by_odmlq(path.read_bytes()) and produced_by_odmlq(exported[0].read_bytes())
    assert _diff(path, inputs, dump) == 0
    out = capsys.readouterr().out
    assert out.startswith(NOT_ODMLQ) and "agree within 1 LSB on every output" in out
    assert out.count("float32") == 1  # the one output, not the intermediate tensors
    assert _diff(path, inputs, dump, "--model", "samples.models:cnn", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["edges"] == [] and data["notes"][0] == NOT_ODMLQ and data["runs"] == ["litert", "device"]
    # The converter computes the float model (float32 noise only).
    assert data["outputs"]["output_0 (litert)"]["sqnr_db"] > 100
    assert data["outputs"]["output_0 (device)"]["sqnr_db"] > 100


def test_nan_on_the_device_is_counted_and_fails_the_gate(plain_float, tmp_path, capsys):
    path, inputs, dump = plain_float
    with np.load(dump) as f:
        tensors = {k: f[k].copy() for k in f.files}
    output = next(k for k in tensors if k.endswith("_output"))
    tensors[output][0, 3] = np.nan
    np.savez(tmp_path / "nan.npz", **tensors)
    assert _diff(path, inputs, tmp_path / "nan.npz", "--min-sqnr", "30", "--model", "samples.models:cnn") == 3
    out = capsys.readouterr().out
    assert "device parts from host at: " + output in out and "(1 NaN)" in out
    row = next(line for line in out.splitlines() if output in line and "out" in line)
    assert " 1 " in row and "inf" in row  # one NaN; the other values agree exactly


def test_inputs_that_do_not_fit_are_named_with_the_shape(exported, tmp_path, capsys):
    path, _ = exported
    dump = _dump(exported, tmp_path)
    np.savez(tmp_path / "two.npz", x=np.zeros((2, 8, 8, 1), np.float32))
    assert _diff(path, tmp_path / "two.npz", dump) == 1
    assert "Input 'serving_default_x' has shape (2, 8, 8, 1); the model takes (1, 8, 8, 1)" in capsys.readouterr().err
    np.savez(tmp_path / "extra.npz", x=np.zeros((1, 8, 8, 1), np.float32), y=np.zeros(3))
    assert _diff(path, tmp_path / "extra.npz", dump) == 1
    assert "The model takes 1 input(s) ('serving_default_x'); the inputs hold x, y" in capsys.readouterr().err
    with pytest.raises(odmlq.OdmlqError, match=r"Input 'x' has shape \(1, 9, 9, 1\); the model takes \('N', 8, 8, 1\)"):
        check_model_inputs(["x"], [np.zeros((1, 9, 9, 1))], (np.zeros((1, 8, 8, 1)),))


def test_json_and_html_reports(exported, tmp_path, capsys):
    path, inputs = exported
    dump = _dump(exported, tmp_path)
    page = tmp_path / "out" / "report.html"
    page.parent.mkdir()
    assert _diff(path, inputs, dump, "--json", "--html", str(page)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "odmlq.report" and data["runs"] == ["device"]
    assert "no model given" in data["notes"][0] and data["outputs"]["output_0 (device)"]["sqnr_db"] is None
    html = page.read_text()
    # The real renderer: one page, the note and the output line, nothing else in the folder.
    assert html.startswith("<!DOCTYPE html>") and "no model given" in html and "</html>" in html
    assert [p.name for p in page.parent.iterdir()] == ["report.html"]
