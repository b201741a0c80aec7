"""Progress on stderr: shown when asked (or on a terminal), never on stdout, never with progress=False."""

import numpy as np
import pytest

import odmlq
from odmlq.progress import Bar, Stage, shown, steps

RULES = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


def test_steps_yield_everything_and_say_what_took_the_time(capsys):
    assert list(steps(range(5), "counting", progress=True, unit="n")) == [0, 1, 2, 3, 4]
    captured = capsys.readouterr()
    assert captured.out == "" and "counting: 5 n in" in captured.err


def test_nothing_is_shown_when_progress_is_false_or_stderr_is_not_a_terminal(capsys):
    assert list(steps(range(3), "counting", progress=False)) == [0, 1, 2]
    assert list(steps(range(3), "counting")) == [0, 1, 2]  # pytest's stderr is no terminal
    with Stage("converting"), Bar("bar", total=2) as bar:
        bar.tick()
    assert capsys.readouterr().err == "" and not shown(None)


def test_a_failed_stage_says_so(capsys):
    with pytest.raises(ValueError), Stage("converting", progress=True):
        raise ValueError("boom")
    assert "converting... failed in" in capsys.readouterr().err


def test_export_shows_calibration_conversion_and_verification(tmp_path, capsys):
    from samples.models import cnn

    model, _, variables = cnn()
    data = np.random.default_rng(0).random((12, 8, 8, 1), np.float32)
    odmlq.export_tflite(model, RULES, [data[:4], data[4:8], data[8:]], tmp_path / "m.tflite",
                        variables=variables, progress=True)
    captured = capsys.readouterr()
    assert "calibrating: 2 batch in" in captured.err
    assert "converting... done in" in captured.err
    assert "verifying: " in captured.err and "row in" in captured.err
    assert "calibrating" not in captured.out


def test_try_fixes_shows_each_fix(capsys):
    from samples.digits import batches
    from tests.report.test_report import planted_fault, trained_cnn

    digits, model, variables, plan, calibration = trained_cnn()
    bad = planted_fault(calibration)
    scales = odmlq.compute_scales(plan, bad, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:16], variables=variables, calibration=bad,
                           rep_dataset=batches(digits.x_calibration, 32), try_fixes=True, progress=True)
    err = capsys.readouterr().err
    assert report.advice and f"trying fixes: {len(report.advice)} fix in" in err, err
