"""LiteRT's start-up INFO lines are dropped, everything else it writes is kept."""

import os
import subprocess
import sys

import numpy as np

import odmlq
from odmlq.litert._runtime import runtime_log_filtered

_OPEN = ("import sys, odmlq.litert as litert; "
         "runner = litert.interpreter(sys.argv[1], num_threads=1); "
         "print(runner.get_input_details()[0]['shape'].tolist())")


def _model(tmp_path):
    from samples.models import mlp

    model, (x,), variables = mlp()
    path = tmp_path / "m.tflite"
    odmlq.export_tflite(model, [], [np.zeros((2, 8, 8, 1), np.float32)], path, variables=variables, verify=False)
    return path


def _run(path, **environment):
    env = {k: v for k, v in os.environ.items() if k != "ODMLQ_VERBOSE"} | environment
    return subprocess.run([sys.executable, "-c", _OPEN, str(path)], capture_output=True, text=True, check=True,
                          env=env)


def test_the_xnnpack_info_line_is_dropped_unless_verbose(tmp_path):
    path = _model(tmp_path)
    quiet = _run(path)
    assert quiet.stdout.strip() == "[1, 8, 8, 1]" and "INFO" not in quiet.stderr, quiet.stderr
    # The line exists to be dropped: with ODMLQ_VERBOSE=1 LiteRT prints it.
    loud = _run(path, ODMLQ_VERBOSE="1")
    assert "INFO: Created TensorFlow Lite XNNPACK delegate" in loud.stderr


def test_other_lines_written_to_descriptor_2_are_kept(capfd):
    with runtime_log_filtered():
        os.write(2, b"INFO: chatter\nERROR: a real problem\n")
    err = capfd.readouterr().err
    assert "ERROR: a real problem" in err and "chatter" not in err
