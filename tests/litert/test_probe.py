"""A model that crashes LiteRT (a signal, not an exception) is tried in a
child process first: the caller gets LiteRTCrashError, keeps running, and
nothing is written."""

import os

import numpy as np
import pytest

import odmlq
from odmlq.litert import LiteRTCrashError, _probe
from odmlq.litert.verify import preserving_interpreter
from samples.models import SAMPLES


def _aborting_child(tmp_path):
    """A stand-in for the interpreter aborting inside allocate_tensors."""
    script = tmp_path / "abort.py"
    script.write_text("import os, signal, sys\nsys.stderr.write('allocate_tensors: check failed\\n')\n"
                      "os.kill(os.getpid(), signal.SIGABRT)\n")
    return str(script)


@pytest.fixture
def exported(tmp_path):
    model, inputs, variables = SAMPLES["mlp"]()
    x = np.random.RandomState(0).rand(16, *np.shape(inputs[0])[1:]).astype(np.float32)
    return model, variables, x


def test_a_crashing_model_becomes_an_error_and_nothing_is_written(exported, tmp_path, monkeypatch):
    model, variables, x = exported
    monkeypatch.setattr(_probe, "_CHILD", _aborting_child(tmp_path))
    _probe._PROBED.clear()
    target = tmp_path / "model.tflite"
    target.write_bytes(b"the user's previous model")
    with pytest.raises(LiteRTCrashError, match=r"(?s)crashed \(SIGABRT\) loading or running the model exported for "
                                               r"'.*model.tflite'.*allocate_tensors: check failed.*Nothing was written"):
        odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], [x[:8], x[8:]],
                            str(target), variables=variables)
    assert target.read_bytes() == b"the user's previous model"
    assert sorted(os.listdir(tmp_path)) == ["abort.py", "model.tflite"]  # no temporary left behind
    _probe._PROBED.clear()


def test_every_interpreter_odmlq_opens_is_probed(exported, tmp_path, monkeypatch):
    model, variables, x = exported
    result = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], [x],
                                 variables=variables, verify=False)
    monkeypatch.setattr(_probe, "_CHILD", _aborting_child(tmp_path))
    _probe._PROBED.clear()
    with pytest.raises(LiteRTCrashError, match="SIGABRT"):
        preserving_interpreter(result.tflite)
    _probe._PROBED.clear()
    monkeypatch.undo()
    preserving_interpreter(result.tflite).invoke()  # a sound model loads as before


def test_a_model_litert_cannot_allocate_is_a_conversion_error(exported, tmp_path, monkeypatch):
    """What a depthwise 16x8 convolution with an int32 bias did before it was repaired."""
    model, variables, x = exported
    script = tmp_path / "refuse.py"
    script.write_text("import sys\nsys.stderr.write('allocate_tensors: depthwise_conv.cc bias->type != kTfLiteInt64\\n')\n"
                      "sys.exit(3)\n")
    monkeypatch.setattr(_probe, "_CHILD", str(script))
    _probe._PROBED.clear()
    with pytest.raises(odmlq.litert.ConversionError, match=r"LiteRT cannot load the exported model: .*kTfLiteInt64"):
        odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")], [x],
                            variables=variables, verify=False)
    _probe._PROBED.clear()
