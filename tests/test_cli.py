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
    assert "XNNPACK: 1 partition," in out and "0 on reference kernels" in out


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


def test_tune_takes_a_latency_budget_and_shows_the_latency(tmp_path, capsys):
    import numpy as np

    data = tmp_path / "data.npz"
    np.savez(data, x=np.random.default_rng(0).random((64, 8, 8, 1), dtype=np.float32))
    # 50x float: a budget any placement meets; what is checked is that it is measured and shown.
    assert cli.main(["tune", "cnn", "--data", str(data), "--min-sqnr", "20", "--max-latency-ratio", "50",
                     "--quiet", "--no-check"]) == 0
    printed = capsys.readouterr().out
    assert "latency <= 50x float" in printed and "vs float" in printed, printed


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
    (["--max-latency-ratio", "0"], "must be positive"),
])
def test_tune_bad_arguments_fail_before_work(tmp_path, capsys, args, match):
    import numpy as np

    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((4, 8, 8, 1), np.float32))
    assert cli.main(["tune", "cnn", "--data", str(data), *args]) == 1
    assert match in capsys.readouterr().err


def _digits_like(path, rows=64, seed=0):
    import numpy as np

    np.savez(path, x=np.random.default_rng(seed).random((rows, 8, 8, 1), dtype=np.float32))
    return str(path)


def test_every_option_of_every_command_says_what_it_does():
    from odmlq.cli import parser

    top = parser()
    commands = next(a for a in top._actions if a.dest == "command").choices
    assert {"demo", "plan", "export", "compare", "tune", "inspect", "ops", "diff"} <= set(commands)
    for name, command in commands.items():
        for action in command._actions:
            if action.dest != "help":
                assert action.help, f"odmlq {name} {action.option_strings or action.dest} has no help"


def test_compare_lines_up_simulate_litert_and_xla(tmp_path, capsys):
    import json

    data = _digits_like(tmp_path / "d.npz")
    html, explorer, saved = tmp_path / "r.html", tmp_path / "me.json", tmp_path / "c.npz"
    assert cli.main(["compare", "cnn", "--data", data, "--litert", "--xla", "--rows", "8", "--json",
                     "--html", str(html), "--model-explorer", str(explorer), "--save-calibration",
                     str(saved), "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"output_0", "output_0 (litert)", "output_0 (xla)"} <= set(report["outputs"])
    assert all(m["sqnr_db"] > 25 for m in report["outputs"].values())  # int8 CNN: 37-45 dB measured
    assert html.read_text().startswith("<!DOCTYPE html>") and json.loads(explorer.read_text())
    import odmlq

    assert len(odmlq.Calibration.load(saved)) > 0


def test_export_saves_the_calibration_its_tflite_was_made_with(tmp_path, capsys):
    import json

    data = _digits_like(tmp_path / "d.npz")
    saved, model = tmp_path / "c.npz", tmp_path / "m.tflite"
    assert cli.main(["export", "cnn", "--data", data, "--out", str(model), "--no-verify",
                     "--save-calibration", str(saved), "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["compare", "cnn", "--data", data, "--calibration", str(saved), "--tflite", str(model),
                     "--json", "--rows", "8", "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Same statistics, same scales: LiteRT computes what simulate does, within
    # the 1 LSB of a kernel's rounding (0 measured). Other statistics would
    # move scales, and the LiteRT run would differ by many LSB.
    lsb = [e["runs"]["litert"]["simulate_lsb"] for e in report["edges"] if "litert" in e["runs"]]
    assert lsb and max(lsb) <= 1.0, lsb


@pytest.mark.parametrize("args, match", [
    (["export", "samples.models:nosuch", "--data", "D", "--out", "/nonexistent/m.tflite"], "/nonexistent"),
    (["export", "samples.models:nosuch", "--data", "D", "--out", "OUT", "--save-calibration",
      "/nonexistent/c.npz"], "/nonexistent"),
    (["export", "samples.models:nosuch", "--data", "/nonexistent.npz", "--out", "OUT"], "Cannot read --data"),
    (["export", "samples.models:nosuch", "--data", "D", "--out", "OUT", "--rules", "BAD"], "rule 0"),
    (["export", "samples.models:nosuch", "--calibration", "/nonexistent.npz", "--out", "OUT"],
     "Cannot read calibration"),
    (["compare", "samples.models:nosuch", "--data", "D", "--html", "/nonexistent/r.html"], "/nonexistent"),
    (["compare", "samples.models:nosuch", "--data", "D", "--model-explorer", "OUT"], "add --litert"),
    (["compare", "samples.models:nosuch", "--data", "D", "--tflite", "/nonexistent.tflite"],
     "Cannot read model"),
    (["tune", "samples.models:nosuch", "--data", "D", "--min-sqnr", "30", "--candidates", "int3"],
     "Unknown candidate"),
])
def test_cheap_checks_come_before_the_model_is_loaded(tmp_path, capsys, args, match):
    # samples.models:nosuch fails when loaded: each error here must come first.
    bad_rules = tmp_path / "bad.yaml"
    bad_rules.write_text("- {module_path: '(', weight_qtype: int8}\n")
    replace = {"D": _digits_like(tmp_path / "d.npz", rows=4), "OUT": str(tmp_path / "out"), "BAD": str(bad_rules)}
    assert cli.main([replace.get(a, a) for a in args]) == 1
    err = capsys.readouterr().err
    assert match in err and "has no function" not in err, err


def test_diff_asks_for_the_calibration_before_reading_the_dump(tmp_path, capsys):
    import numpy as np

    data = _digits_like(tmp_path / "d.npz", rows=4)
    model = tmp_path / "m.tflite"
    assert cli.main(["export", "cnn", "--data", data, "--out", str(model), "--no-verify", "--quiet"]) == 0
    np.savez(tmp_path / "in.npz", x=np.zeros((1, 8, 8, 1), np.float32))
    np.savez(tmp_path / "dump.npz", unrelated=np.zeros(3))  # diffing it would fail otherwise
    assert cli.main(["diff", str(model), "--inputs", str(tmp_path / "in.npz"), "--device-tensors",
                     str(tmp_path / "dump.npz"), "--model", "cnn"]) == 1
    assert "needs --calibration" in capsys.readouterr().err


def test_export_says_when_there_is_no_calibration_to_save(tmp_path, capsys):
    rules = tmp_path / "w.yaml"
    rules.write_text("- {module_path: '.*', weight_qtype: int8, weight_algorithm: nearest}\n")
    saved = tmp_path / "c.npz"
    assert cli.main(["export", "mlp", "--data", _digits_like(tmp_path / "d.npz", rows=4), "--rules", str(rules),
                     "--out", str(tmp_path / "m.tflite"), "--save-calibration", str(saved), "--quiet"]) == 0
    assert "calibrate no activation" in capsys.readouterr().err and not saved.exists()


def test_a_weight_only_export_saves_the_statistics_its_gptq_weights_were_rounded_with(tmp_path):
    """GPTQ (the default) rounds weights against the data's inputs, weight-only too."""
    from odmlq.calibration import Calibration

    rules = tmp_path / "w.yaml"
    rules.write_text("- {module_path: '.*', weight_qtype: int8}\n")
    saved = tmp_path / "c.npz"
    assert cli.main(["export", "mlp", "--data", _digits_like(tmp_path / "d.npz", rows=4), "--rules", str(rules),
                     "--out", str(tmp_path / "m.tflite"), "--save-calibration", str(saved), "--quiet"]) == 0
    assert Calibration.load(saved).grams


def test_verbose_is_taken_before_or_after_the_command(capsys, monkeypatch):
    from odmlq.litert import VERBOSE_ENVIRONMENT

    # setenv, not delenv: monkeypatch records nothing for deleting an absent variable, and the
    # "1" cli.main sets would then outlive the test (later tests would see LiteRT's INFO lines).
    monkeypatch.setenv(VERBOSE_ENVIRONMENT, "0")
    assert cli.main(["ops", "--verbose"]) == 0
    import os

    assert os.environ[VERBOSE_ENVIRONMENT] == "1"
    monkeypatch.setenv(VERBOSE_ENVIRONMENT, "0")
    assert cli.main(["--verbose", "ops"]) == 0 and os.environ[VERBOSE_ENVIRONMENT] == "1"


def test_demo_refuses_a_nonpositive_budget(capsys):
    assert cli.main(["demo", "--seconds", "0"]) == 1
    assert "--seconds 0" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["samples/dump_tensors.py", "samples/minilm_tflite.py", "samples/digits.py",
                                    "samples/digits_cnn.py", "samples/qat_digits.py", "samples/qlora_minilm.py"])
def test_every_sample_script_prints_its_usage(script):
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr


def test_dump_tensors_without_arguments_prints_its_usage():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "samples/dump_tensors.py"], capture_output=True, text=True, cwd=root)
    assert done.returncode == 2 and "usage:" in done.stderr and "Traceback" not in done.stderr


def test_export_external_weights_writes_them_after_the_flatbuffer(tmp_path, capsys):
    from ai_edge_litert import schema_py_generated as schema

    data = _digits_like(tmp_path / "d.npz", rows=8)
    offsets = {}
    for flag in ("--external-weights", "--inline-weights"):
        out = tmp_path / f"{flag[2:]}.tflite"
        assert cli.main(["export", "cnn", "--data", data, "--out", str(out), "--quiet", flag]) == 0
        model = schema.Model.GetRootAsModel(out.read_bytes(), 0)
        offsets[flag] = [model.Buffers(b).Offset() for b in range(model.BuffersLength())
                         if model.Buffers(b).Offset() > 1]
        assert "of simulate: yes" in capsys.readouterr().out
    assert len(offsets["--external-weights"]) == 4 and not offsets["--inline-weights"]


def test_export_times_a_small_model_against_float_unless_told_not_to(tmp_path, capsys):
    """The digits CNN is 0.15 MB of float weights: `odmlq export` times it
    against its float twin by default (the latency lines), and not with
    --no-benchmark."""
    data = _digits_like(tmp_path / "d.npz", rows=8)
    out = tmp_path / "m.tflite"
    assert cli.main(["export", "cnn", "--data", data, "--out", str(out), "--quiet", "--no-verify"]) == 0
    printed = capsys.readouterr().out
    from odmlq.litert.speed import benchmark_threads

    assert "latency: " in printed and "x float" in printed
    assert ("latency, 2 threads: " in printed) == (2 in benchmark_threads())
    assert cli.main(["export", "cnn", "--data", data, "--out", str(out), "--quiet", "--no-verify",
                     "--no-benchmark"]) == 0
    assert "latency" not in capsys.readouterr().out
