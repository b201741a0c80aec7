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


def test_inspect_prints_ops_and_float_islands(tmp_path, capsys):
    import numpy as np

    import odmlq
    from samples.models import cnn

    model, (x,), variables = cnn()
    data = np.random.default_rng(0).random((16, 8, 8, 1), np.float32)
    path = tmp_path / "m.tflite"
    odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                        [data[:8], data[8:]], path, variables=variables, verify=False)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "CONV_2D" in out and "conv2/relu" in out and "0 float islands" in out


def test_inspect_bad_file(tmp_path, capsys):
    bad = tmp_path / "x.tflite"
    bad.write_bytes(b"not a model at all")
    assert cli.main(["inspect", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().err


def test_export_with_calibration_file(tmp_path, capsys):
    import numpy as np

    import odmlq
    from samples.models import mlp

    model, (x,), variables = mlp()
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    p = odmlq.plan(model, rules, x, variables=variables)
    data = np.random.default_rng(0).random((32, 8, 8, 1), np.float32)
    odmlq.calibrate(model, p, [data], variables=variables).save(tmp_path / "cal.npz")
    np.savez(tmp_path / "data.npz", x=data[:4])
    out = tmp_path / "m.tflite"
    assert cli.main(["export", "samples.models:mlp", "--out", str(out), "--calibration",
                     str(tmp_path / "cal.npz"), "--data", str(tmp_path / "data.npz")]) == 0
    printed = capsys.readouterr().out
    assert out.exists() and "float islands: none" in printed and "every op within 1 LSB" in printed


def test_export_needs_representative_data(tmp_path, capsys):
    assert cli.main(["export", "samples.models:mlp", "--out", str(tmp_path / "m.tflite")]) == 1
    assert "needs --calibration" in capsys.readouterr().err


def test_demo_names_a_missing_dependency(monkeypatch, capsys):
    """Not 'install from a checkout' when what is missing is a package the demo needs."""
    import samples

    for name in ("digits_cnn", "digits"):
        # Both the module cache and the package attribute: `from samples import digits_cnn`
        # finds an earlier test's import through either.
        monkeypatch.delitem(sys.modules, f"samples.{name}", raising=False)
        monkeypatch.delattr(samples, name, raising=False)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now fails
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert cli.main(["demo"]) != 0
    err = capsys.readouterr().err
    assert "odmlq demo needs the package 'sklearn" in err and "which is not installed" in err, err


def test_tune_writes_rules_that_plan_again(tmp_path, capsys):
    import numpy as np

    import odmlq

    data = tmp_path / "data.npz"
    np.savez(data, x=np.random.default_rng(0).random((64, 8, 8, 1), dtype=np.float32))
    out = tmp_path / "rules.yaml"
    assert cli.main(["tune", "cnn", "--data", str(data), "--min-sqnr", "20", "--out", str(out), "--quiet",
                     "--no-check"]) == 0
    printed = capsys.readouterr().out
    assert "autotune: met" in printed and "rules:" in printed
    rules = odmlq.load_rules(out)
    assert rules and rules[-1].module_path == ".*"


def test_tune_says_when_the_target_is_not_met(tmp_path, capsys):
    import numpy as np

    data = tmp_path / "data.npz"
    np.savez(data, x=np.random.default_rng(0).random((32, 8, 8, 1), dtype=np.float32))
    assert cli.main(["tune", "cnn", "--data", str(data), "--min-sqnr", "300", "--candidates", "int8",
                     "--quiet", "--no-check"]) == 3
    assert "not met" in capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    ([], "needs a floor or a budget"),
    (["--min-cosine", "0.99", "--out", "/nonexistent/dir/rules.yaml"], "nonexistent"),
    (["--min-cosine", "0.99", "--candidates", "int3"], "Unknown candidate"),
])
def test_tune_bad_arguments_fail_before_work(tmp_path, capsys, args, match):
    import numpy as np

    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((4, 8, 8, 1), np.float32))
    assert cli.main(["tune", "cnn", "--data", str(data), *args]) == 1
    assert match in capsys.readouterr().err
