"""Quantize JAX/Flax and Keras models for XLA and LiteRT from one set of rules, and
line every layer up against float.

  odmlq demo [--out DIR] [--seconds S]   train the digits CNN, export int8, compare
  odmlq plan SAMPLE|module:function [--rules rules.yaml] [--json]
  odmlq export MODEL --out model.tflite (--data D.npz | --calibration C.npz) [--rules R]
             [--save-calibration C.npz]
  odmlq compare MODEL --data D.npz [--rules R] [--calibration C.npz] [--litert | --tflite M.tflite] [--xla]
             [--try-fixes] [--json] [--html out.html] [--model-explorer out.json]
  odmlq tune MODEL --data D.npz (--min-cosine C | --min-sqnr DB | --max-bits-per-weight B | --max-bytes N
                                 | --max-latency-ratio R)
             [--backend litert|xla|both] [--out rules.yaml]
  odmlq inspect model.tflite
  odmlq ops                              what each op kind becomes on LiteRT, per schema
  odmlq diff model.tflite --inputs in.npz --device-tensors dump.npz [--min-sqnr 30]
             [--model MODEL [--rules R] [--calibration C.npz]] [--json] [--html out.html]
             [--model-explorer out.json]

MODEL is one of the bundled sample models (``odmlq plan --list``) or a
``module:function`` naming a function that takes no arguments and returns
``(model, example_inputs, variables)`` (variables may be None for NNX). Every
file a command reads or writes is checked before the model is traced.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator

import numpy as np

from odmlq import _arguments
from odmlq.errors import OdmlqError
from odmlq.files import check_output_path, load_batches, read_arrays, read_model_file

# The one-line rule, full integer: `odmlq diff` and `odmlq compare --tflite` line a file up
# with the model by planning it again, so the default is what files were made with before
# odmlq.INT8 (a rules file with `float_outputs: true` asks for that).
DEFAULT_RULES = ("int8 weights (per-channel) and int8 activations everywhere, outputs too "
                 "(odmlq.FULL_INTEGER_INT8; --rules with float_outputs: true for odmlq.INT8)")

# The repository's samples are loaded by name, as any user's module:function
# is: odmlq itself never depends on them (an installed odmlq may lack them).
SAMPLES_MODULE = "samples.models"


def samples() -> dict:
    try:
        return importlib.import_module(SAMPLES_MODULE).SAMPLES
    except ImportError:  # an installed odmlq without the repository's samples/
        return {}


def load_model(target: str):
    """(model, example_inputs, variables) from a sample name or module:function."""
    found = samples()
    if target in found:
        return found[target]()
    if ":" not in target:
        raise OdmlqError(
            f"Unknown model {target!r}: give a sample ({', '.join(sorted(found)) or 'none installed'}) "
            "or module:function returning (model, example_inputs, variables)."
        )
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise OdmlqError(f"Cannot import module {module_name!r} from {target!r}: {e}.") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise OdmlqError(f"{target!r}: module {module_name!r} has no function {function_name!r}.")
    result = fn()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise OdmlqError(
            f"{target!r} returned {type(result).__name__}; it must return "
            "(model, example_inputs) or (model, example_inputs, variables)."
        )
    model, inputs, variables = (*result, None)[:3]
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs), variables


def rules_from(path: str | None):
    """Rules from a file, or the default rule (said on stderr)."""
    from odmlq.rules import FULL_INTEGER_INT8, load_rules

    if path:
        return load_rules(path)
    print(f"# no --rules given: {DEFAULT_RULES}", file=sys.stderr)
    return list(FULL_INTEGER_INT8)


def load_calibration(path: str | None):
    from odmlq.calibration import Calibration

    if path is None:
        return None
    if not os.path.isfile(path):
        raise OdmlqError(f"Cannot read calibration {path!r}: no such file; give the .npz Calibration.save "
                         "(or odmlq export --save-calibration) wrote.")
    return Calibration.load(path)


def writable(*paths: str | None) -> None:
    """Every output path given can be written (before any work)."""
    for path in paths:
        if path is not None:
            check_output_path(path)


@contextlib.contextmanager
def warnings_on_stderr() -> Iterator[None]:
    """Python warnings raised inside, printed as ``warning: ...`` lines."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)


DEMO_MODULE = "samples.digits_cnn"


def _progress_of(args) -> bool | None:
    """--quiet: no progress; otherwise shown where stderr is a terminal."""
    return False if getattr(args, "quiet", False) else None


def _cmd_plan(args) -> int:
    from odmlq.targets import plan as make_plan

    rules = rules_from(args.rules)
    model, inputs, variables = load_model(args.model)
    with warnings_on_stderr():
        p = make_plan(model, rules, *inputs, variables=variables)
    print(p.to_json() if args.json else p)
    return 0


def _cmd_export(args) -> int:
    from odmlq.litert.export import export_tflite

    if args.data is None and args.calibration is None:
        raise OdmlqError("odmlq export needs --calibration C.npz or --data D.npz (representative inputs).")
    writable(args.out, args.save_calibration)
    rules = rules_from(args.rules)
    calibration = load_calibration(args.calibration)
    data = load_batches(args.data, args.batch_size, "--data") if args.data else None
    model, inputs, variables = load_model(args.model)
    with warnings_on_stderr():
        result = export_tflite(model, rules, data or [tuple(inputs)], args.out, variables=variables,
                               example_inputs=inputs, calibration=calibration, verify=not args.no_verify,
                               allow_float_ops=args.allow_float_ops, require_delegate=args.require_delegate,
                               benchmark=args.benchmark, external_weights=args.external_weights,
                               progress=_progress_of(args))
    print(result)
    if args.save_calibration:
        if result.calibration is None:
            print(f"# {args.save_calibration} not written: these rules calibrate no activation "
                  "(dynamic, weight-only or float)", file=sys.stderr)
        else:
            result.calibration.save(args.save_calibration)
            print(f"# wrote {args.save_calibration}", file=sys.stderr)
    return 0


def _cmd_tune(args) -> int:
    from odmlq.report.tune import TuneTarget, autotune, parse_candidates

    target = TuneTarget(min_sqnr_db=args.min_sqnr, min_cosine=args.min_cosine,
                        max_bits_per_weight=args.max_bits_per_weight, max_bytes=args.max_bytes,
                        max_latency_ratio=args.max_latency_ratio, max_latency_ms=args.max_latency_ms)
    writable(args.out)
    data = load_batches(args.data, args.batch_size, "--data")
    evaluation = load_batches(args.eval_data, args.batch_size, "--eval-data") if args.eval_data else None
    candidates = parse_candidates([c for c in args.candidates.split(",") if c]) if args.candidates else None
    model, inputs, variables = load_model(args.model)
    result = autotune(model, variables, data, target=target, eval_inputs=evaluation, candidates=candidates,
                      backend=args.backend, example_inputs=inputs, max_trials=args.max_trials,
                      check=not args.no_check, progress=_progress_of(args))
    print(result)
    if args.out:
        result.save_rules(args.out)
        print(f"# wrote {args.out}", file=sys.stderr)
    if not result.met:
        print("odmlq: the target is not met; the rules above are the closest measured", file=sys.stderr)
        return 3
    return 0


def _cmd_inspect(args) -> int:
    from odmlq.litert._probe import probe
    from odmlq.litert.inspect import inspect as inspect_model
    from odmlq.litert.speed import delegation

    summary = inspect_model(args.model)
    print(summary)
    with open(args.model, "rb") as f:
        tflite = f.read()
    probe(tflite, repr(args.model))  # a file that crashes LiteRT is reported, not loaded here
    print(delegation(tflite, summary))
    return 0


def _cmd_ops(args) -> int:
    from odmlq.litert import coverage

    print(coverage.markdown(), end="")
    return 0


def _cmd_demo(args) -> int:
    if args.seconds <= 0:
        raise OdmlqError(f"--seconds {args.seconds:g}: give a positive training time budget.")
    try:
        digits_cnn = importlib.import_module(DEMO_MODULE)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] != "samples":
            raise OdmlqError(f"odmlq demo needs the package {e.name!r}, which is not installed; "
                             "reinstall odmlq (python -m pip install -e .).") from None
        raise OdmlqError("odmlq demo needs the repository's samples/ (install odmlq from a checkout).") from None
    digits_cnn.main(args.out, args.seconds)
    return 0


def _cmd_compare(args) -> int:
    """Quantize a model by its rules and line every edge up against float."""
    from odmlq.calibration import calibrate, needs_calibration
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
    if calibration is None and needs_calibration(plan):
        calibration = calibrate(model, plan, data, variables=variables, progress=False if args.quiet else None)
    scales = compute_scales(plan, calibration, params_for(model, variables, "odmlq compare"))
    inputs = _rows(shown if shown is not None else data, args.rows)
    if args.litert:
        tflite = _export_now(model, plan, data, calibration, variables, example_inputs)
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


def _export_now(model, plan, data, calibration, variables, example_inputs) -> bytes:
    from odmlq.litert.export import export_tflite

    with warnings_on_stderr():
        return export_tflite(model, plan, data, None, variables=variables, calibration=calibration,
                             example_inputs=tuple(np.asarray(x)[:1] for x in example_inputs),
                             verify=False, benchmark=False).tflite


def _cmd_diff(args) -> int:
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
    from odmlq.calibration import calibrated_edges, needs_calibration
    from odmlq.graph import params_for
    from odmlq.scales import compute_scales
    from odmlq.targets import plan as make_plan

    with warnings_on_stderr():
        p = make_plan(model, rules, *example_inputs, variables=variables)
    if calibrated_edges(p) and calibration is None:
        raise OdmlqError("odmlq diff --model needs --calibration C.npz for a model with calibrated "
                         "activations: the statistics the .tflite was exported with (odmlq export "
                         "--save-calibration, or Calibration.save).")
    if needs_calibration(p) and calibration is None:  # weights only: nearest, unless told otherwise
        print("odmlq diff: weights rounded to nearest (no --calibration); for a .tflite exported "
              "with data (GPTQ weights) pass its statistics: --calibration C.npz.", file=sys.stderr)
    return p, compute_scales(p, calibration, params_for(model, variables, "odmlq diff"))


def parser() -> argparse.ArgumentParser:
    """The command line's parser (`odmlq._arguments`), described by this module's docstring."""
    return _arguments.parser(" ".join(__doc__.split("\n\n")[0].split()))


COMMANDS = {"demo": _cmd_demo, "plan": _cmd_plan, "export": _cmd_export, "compare": _cmd_compare,
            "tune": _cmd_tune, "inspect": _cmd_inspect, "ops": _cmd_ops, "diff": _cmd_diff}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.verbose:
        from odmlq.litert import VERBOSE_ENVIRONMENT

        os.environ[VERBOSE_ENVIRONMENT] = "1"  # also read by the child processes LiteRT runs in
    try:
        if args.command == "plan" and (args.list or not args.model):
            print("samples: " + ", ".join(sorted(samples())))
            return 0 if args.list else 2
        return COMMANDS[args.command](args)
    except OdmlqError as e:
        print(f"odmlq: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
