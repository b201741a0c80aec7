"""compare() advice: rules for the edges that lose accuracy, measured on the planted-fault CNN."""

import dataclasses
import re
import warnings

import numpy as np
import pytest

import odmlq
from odmlq.litert.verify import verify
from odmlq.rules import UnmatchedRuleWarning
from samples.digits import batches
from tests.report.test_report import INT8, planted_fault, trained_cnn


@pytest.fixture(scope="module")
def faulty():
    digits, model, variables, plan, calibration = trained_cnn()
    bad = planted_fault(calibration)
    scales = odmlq.compute_scales(plan, bad, variables)
    return digits, model, variables, plan, bad, scales


def test_recalibrating_the_planted_fault_measures_its_gain(faulty):
    digits, model, variables, plan, calibration, scales = faulty
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables,
                           calibration=calibration, rep_dataset=batches(digits.x_calibration, 32),
                           try_fixes=True)
    assert {a.edge for a in report.advice} == {"conv2/relu"}, str(report)
    by_change = {a.change: a for a in report.advice}
    fix = by_change["act_calibration=MinMax()"]
    assert fix.rule.module_path == re.escape("conv2") and "FixedRange" in fix.why and "clip" in fix.why
    baseline = report.outputs["output_0"].sqnr_db
    # A tenth of the range clipped a third of conv2's outputs: the full range restores the model.
    assert fix.measured.gain_db > 20 and fix.measured.output_sqnr_db > 35, str(report)
    assert fix.measured.output_sqnr_db - fix.measured.gain_db == pytest.approx(baseline, abs=0.5)
    assert fix.measured.size_bytes is None  # no .tflite compared
    # Clipping, not rounding: int16 steps would not help, and are not offered.
    assert not any("int16" in a.change for a in report.advice)
    assert by_change["skip=True (keep in float)"].rule.skip
    assert "Advice" in str(report) and f"{fix.measured.gain_db:+.1f}" in str(report)


def test_a_suggested_rule_is_first_in_the_rules_and_matches_only_its_module(faulty):
    digits, model, variables, plan, calibration, scales = faulty
    report = odmlq.compare(model, plan, scales, digits.x_test[:8], variables=variables, calibration=calibration)
    rule = next(a.rule for a in report.advice if a.change.startswith("act_calibration"))
    new = odmlq.plan(model, [rule, *plan.rules], digits.x_test[:1], variables=variables)
    decided = {e for e, p in new.edges.items() if p.rule == 0}
    assert decided == {"conv2/conv", "conv2/relu", "conv2/reshape"}
    assert all(a.measured is None for a in report.advice)  # not measured without try_fixes


def test_a_rounding_edge_gets_int16_and_it_measures_a_gain():
    """An int8 edge with a range 30x wider than its values: rounding, not clipping.

    Planned for XLA alone: with LiteRT's constraints the reshape after conv2
    shares conv2/relu's (30x wide) scale and dense1 reads it through an int8
    conversion of that range, so int16 there gains nothing on LiteRT."""
    digits, model, variables, _, _ = trained_cnn()
    plan = odmlq.plan(model, INT8, digits.x_test[:1], variables=variables, target="xla")
    calibration = odmlq.calibrate(model, plan, batches(digits.x_calibration, 32), variables=variables)
    method, stats = calibration["conv2/relu"]
    entries = dict(calibration)
    entries["conv2/relu"] = (method, dataclasses.replace(stats, max=stats.max * 30))
    wide = odmlq.Calibration(entries)
    scales = odmlq.compute_scales(plan, wide, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:64], variables=variables, calibration=wide,
                           try_fixes=True)
    int16 = next(a for a in report.advice if "int16" in a.change)
    assert int16.edge == "conv2/relu" and int16.rule.act_qtype == "int16" and int16.rule.weight_qtype == "int8"
    assert int16.measured.gain_db > 3, str(report)


def test_with_a_tflite_fixes_are_exported_int16_reading_an_int8_pool_included():
    """int16 for conv2 alone makes it read the int8 average pool (a depthwise
    convolution on LiteRT) through a requantization, which the LiteRT lowering
    keeps apart from the pool with a same-scale MAXIMUM (the converter would
    fold it into the pool): offered, re-exported, and the .tflite computes what
    simulate does, whatever the gain. LiteRT and simulate differ by at most 1
    LSB per op (the re-export's verification on the 32 images asserts it).
    The outputs' SQNR against float may differ by up to 1 dB: LiteRT's QUANTIZE
    from int16 to int8 rounds twice (a rounding high multiply, then a rounding
    shift right by 2, reproduced on all 512 of conv2's values), so 9% of the
    int8 copy is 1 LSB above simulate's one rounding, which moves the logits,
    whose error against float is about 1 LSB rms at 40 dB (measured: 39.3 dB
    in LiteRT, 40.0 in simulate)."""
    digits, model, variables, plan, calibration = trained_cnn()
    method, stats = calibration["conv2/relu"]
    wide = odmlq.Calibration({**dict(calibration),
                              "conv2/relu": (method, dataclasses.replace(stats, max=stats.max * 30))})
    result = odmlq.export_tflite(model, plan, None, variables=variables, calibration=wide,
                                 example_inputs=(digits.x_test[:1],), verify=False)
    report = odmlq.compare(model, plan, result.scales, digits.x_test[:32], variables=variables,
                           calibration=wide, tflite=result.tflite, try_fixes=True)
    int16 = next(a for a in report.advice if "int16" in a.change)
    assert int16.edge == "conv2/relu" and int16.measured.size_bytes is not None, str(report)
    assert int16.measured.litert_output_sqnr_db == pytest.approx(int16.measured.output_sqnr_db, abs=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnmatchedRuleWarning)
        replanned = plan.replan((int16.rule, *plan.rules))
    again = odmlq.export_tflite(model, replanned, None, variables=variables, calibration=wide,
                                example_inputs=(digits.x_test[:1],), verify=False, benchmark=False)
    check = verify(again.tflite, model, replanned, again.scales, [digits.x_test[:32]],
                   variables=variables, raise_on_failure=False)
    assert check.passed, str(check)
    skip = next(a for a in report.advice if a.rule.skip)
    m = skip.measured
    assert m.size_bytes == len(result.tflite) + m.size_delta_bytes and m.size_delta_bytes > 0  # float conv2
    # The re-exported model computes what simulate does (its float island included).
    assert m.gain_db > 3 and m.litert_output_sqnr_db == pytest.approx(m.output_sqnr_db, abs=0.5)


def test_try_fixes_needs_the_calibration(faulty):
    digits, model, variables, plan, _, scales = faulty
    with pytest.raises(odmlq.CalibrationError, match="try_fixes=True. needs calibration="):
        odmlq.compare(model, plan, scales, digits.x_test[:8], variables=variables, try_fixes=True)


def test_a_fix_that_needs_new_statistics_without_data_says_so(faulty):
    digits, model, variables, plan, calibration, scales = faulty
    report = odmlq.compare(model, plan, scales, digits.x_test[:8], variables=variables,
                           calibration=calibration, try_fixes=True)
    fix = next(a for a in report.advice if a.change.startswith("act_calibration"))
    assert fix.measured is None
    assert any("not measured" in n and "rep_dataset" in n and "conv2/relu" in n for n in report.notes)
    skip = next(a for a in report.advice if a.rule.skip)
    assert skip.measured is not None and skip.measured.gain_db > 20  # needs no new statistics


def test_a_clean_model_gets_no_advice():
    digits, model, variables, plan, calibration = trained_cnn()
    scales = odmlq.compute_scales(plan, calibration, variables)
    report = odmlq.compare(model, plan, scales, digits.x_test[:32], variables=variables,
                           calibration=calibration, try_fixes=True)
    assert report.advice == () and "Advice" not in str(report)
    assert np.isfinite(report.outputs["output_0"].sqnr_db)


@pytest.mark.parametrize("base", [odmlq.INT8[0], odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8"),
                                  odmlq.Rule("dense", act_qtype="int8", act_symmetric=False)])
def test_the_int16_twin_of_any_int8_rule_is_a_rule(base):
    """Advice for an error spread over a model quantized by `odmlq.INT8` built
    its int16x8 twin with float_outputs=True, which the Rule refuses: compare
    raised a RuleError instead of reporting (transformers' CLIP vision tower)."""
    from odmlq.report._advice import int16_twin

    twin = int16_twin(base, module_path="dense/.*")
    assert twin.act_qtype == "int16" and twin.module_path == "dense/.*" and not twin.float_outputs
    assert twin.weight_qtype == ("int8" if base.weight_qtype is not None else None)
