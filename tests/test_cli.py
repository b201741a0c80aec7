import subprocess
import sys

import pytest

from odmlq import cli


def test_plan_sample_prints_the_table(capsys):
    assert cli.main(["plan", "cnn"]) == 0
    out = capsys.readouterr().out
    assert "Plan for LinenCNN (linen)" in out
    assert "conv1/kernel: int8 per-channel[3] sym narrow absmax" in out


def test_plan_with_rules_file_and_json(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {module_path: head, skip: true}\n- {module_path: '.*', weight_qtype: int8}\n")
    assert cli.main(["plan", "mlp_nnx", "--rules", str(rules), "--json"]) == 0
    assert '"format": "odmlq.plan"' in capsys.readouterr().out


def test_plan_module_function(capsys):
    assert cli.main(["plan", "samples.models:mlp"]) == 0
    assert "head/dot_general" in capsys.readouterr().out


@pytest.mark.parametrize("target, match", [
    ("nosuch", "Unknown model 'nosuch'"),
    ("samples.models:nosuch", "has no function 'nosuch'"),
    ("no_such_module:f", "Cannot import module 'no_such_module'"),
])
def test_plan_bad_model(target, match, capsys):
    assert cli.main(["plan", target]) == 1
    assert match in capsys.readouterr().err


def test_bad_rules_file_is_reported(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {module_path: '(', weight_qtype: int8}\n")
    assert cli.main(["plan", "mlp", "--rules", str(rules)]) == 1
    assert "rule 0" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "odmlq.cli", "plan", "--list"],
                         capture_output=True, text=True, check=True).stdout
    assert "cnn_nnx" in out
