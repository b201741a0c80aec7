"""The commands that measure: compare (float, simulate, XLA, LiteRT, edge by
edge) and diff (a device's tensors against the host interpreter)."""

from __future__ import annotations

import sys

import numpy as np

from odmlq.cli._inputs import (load_batches, load_calibration, load_model, read_arrays, read_model_file,
                               rules_from, warnings_on_stderr, writable)
from odmlq.errors import OdmlqError


def compare(args) -> int:
    """Quantize a model by its rules and line every edge up against float."""
    from odmlq.calibration import calibrate
    from odmlq.graph import params_for
    from odmlq.scales import compute_scales
    from odmlq.targets import plan as make_plan

    if args.model_explorer and not (args.tflite or args.litert):
        raise OdmlqError("--model-explorer colours the ops of a .tflite: add --litert (export now) or "
                         "--tflite M.tflite.")
    if args.tflite and args.litert:
        raise OdmlqError("--tflite compares a file already exported, --litert exports one now: give one.")
    if args.rows < 1:
        raise OdmlqError(f"--rows {args.rows} must be at least 1.")
    writable(args.html, args.model_explorer, args.save_calibration)
    rules = rules_from(args.rules)
    calibration = load_calibration(args.calibration)
    data = load_batches(args.data, args.batch_size, "--data")
    shown = read_arrays(args.eval_data, "--eval-data") if args.eval_data else None
    tflite = read_model_file(args.tflite) if args.tflite else None
    model, example_inputs, variables = load_model(args.model)
    with warnings_on_stderr():
        plan = make_plan(model, rules, *example_inputs, variables=variables)
    static = any(e.spec is not None and not e.spec.dynamic for e in plan.edges.values())
    if calibration is None and static:
        calibration = calibrate(model, plan, data, variables=variables, progress=False if args.quiet else None)
    scales = compute_scales(plan, calibration, params_for(model, variables, "odmlq compare"))
    inputs = _rows(shown if shown is not None else data, args.rows)
    if args.litert:
        tflite = _export(model, plan, data, calibration, variables, example_inputs)
    xla = None
    if args.xla:
        from odmlq.targets import ptq

        xla = ptq(model, plan, variables, calibration)
    from odmlq.report import compare as compare_runs

    report = compare_runs(model, plan, scales, *inputs, variables=variables, tflite=tflite, xla=xla,
                          calibration=calibration, rep_dataset=data, try_fixes=args.try_fixes,
                          progress=False if args.quiet else None)
    print(report.to_json(indent=None) if args.json else report)
    if args.html:
        report.save_html(args.html)
        print(f"# wrote {args.html}", file=sys.stderr)
    if args.model_explorer:
        report.save_model_explorer(args.model_explorer, tflite, plan=plan, scales=scales)
        print(f"# wrote {args.model_explorer}", file=sys.stderr)
    if args.save_calibration and calibration is not None:
        calibration.save(args.save_calibration)
        print(f"# wrote {args.save_calibration}", file=sys.stderr)
    if args.min_sqnr is not None:
        worst = min(m.sqnr_db for m in report.outputs.values())
        if worst < args.min_sqnr:
            print(f"odmlq: outputs at {worst:.1f} dB, under --min-sqnr {args.min_sqnr:g}", file=sys.stderr)
            return 3
    return 0


def _rows(source, rows: int) -> tuple:
    """The first `rows` rows of every input, from an .npz's arrays or batches."""
    if isinstance(source, dict):
        return tuple(np.asarray(a)[:rows] for a in source.values())
    columns = zip(*source)
    return tuple(np.concatenate([np.asarray(x) for x in column])[:rows] for column in columns)


def _export(model, plan, data, calibration, variables, example_inputs) -> bytes:
    from odmlq.litert.export import export_tflite

    with warnings_on_stderr():
        return export_tflite(model, plan, data, None, variables=variables, calibration=calibration,
                             example_inputs=tuple(np.asarray(x)[:1] for x in example_inputs),
                             verify=False).tflite


def diff(args) -> int:
    """A device's dump of every tensor, against the host interpreter (and float)."""
    from odmlq.litert.device import check_model_inputs, diff_device, produced_by_odmlq
    from odmlq.report import device_report

    if (args.rules or args.calibration) and not args.float_model:
        raise OdmlqError("--rules and --calibration describe the model given with --model module:function; "
                         "add --model.")
    if args.model_explorer and not args.float_model:
        raise OdmlqError("--model-explorer needs --model (and --calibration): the device's SQNR is measured "
                         "per edge of the plan the .tflite was exported from.")
    writable(args.html, args.model_explorer)
    tflite = read_model_file(args.model)
    inputs = read_arrays(args.inputs, "--inputs")
    dump = read_arrays(args.device_tensors, "--device-tensors")
    rules = rules_from(args.rules) if args.float_model else None
    calibration = load_calibration(args.calibration)
    model = variables = plan = scales = None
    ours = produced_by_odmlq(tflite)
    if args.model_explorer and not ours:
        raise OdmlqError("--model-explorer needs a .tflite odmlq exported (its tensors name the plan's "
                         "edges); this one is compared at its outputs only.")
    if args.float_model:
        model, example_inputs, variables = load_model(args.float_model)
        check_model_inputs(list(inputs), list(inputs.values()), example_inputs)
        if ours:  # a .tflite not made by odmlq is compared at its outputs only
            plan, scales = _plan_and_scales(rules, calibration, model, example_inputs, variables)
    result = diff_device(tflite, inputs, dump)
    report = device_report(tflite, inputs, dump, result, model=model, variables=variables, plan=plan,
                           scales=scales)
    if args.json:
        print(report.to_json(indent=None))
    else:
        print(result)
        if model is not None:
            print()
            print(report)
    if args.html:
        report.save_html(args.html)
        print(f"# wrote {args.html}", file=sys.stderr)
    if args.model_explorer:
        report.save_model_explorer(args.model_explorer, tflite, plan=plan, scales=scales, metric="device")
        print(f"# wrote {args.model_explorer}", file=sys.stderr)
    if args.min_sqnr is not None and result.output_sqnr_db < args.min_sqnr:
        print(f"odmlq: outputs at {result.output_sqnr_db:.1f} dB, under --min-sqnr {args.min_sqnr:g}",
              file=sys.stderr)
        return 3
    return 0


def _plan_and_scales(rules, calibration, model, example_inputs, variables):
    """The plan and scales an odmlq .tflite was exported with."""
    from odmlq.graph import params_for
    from odmlq.scales import compute_scales
    from odmlq.targets import plan as make_plan

    with warnings_on_stderr():
        p = make_plan(model, rules, *example_inputs, variables=variables)
    static = any(e.spec is not None and not e.spec.dynamic for e in p.edges.values())
    if static and calibration is None:
        raise OdmlqError("odmlq diff --model needs --calibration C.npz for a model with calibrated "
                         "activations: the statistics the .tflite was exported with (odmlq export "
                         "--save-calibration, or Calibration.save).")
    return p, compute_scales(p, calibration, params_for(model, variables, "odmlq diff"))
