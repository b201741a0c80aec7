"""The `odmlq` command line.

  odmlq demo [--out DIR]                 train the digits CNN, export int8, compare
  odmlq plan SAMPLE|module:function [--rules rules.yaml] [--json]
  odmlq export module:function --out model.tflite [--rules R] [--calibration C.npz] [--data D.npz]
  odmlq tune module:function --data D.npz (--min-cosine C | --min-sqnr DB | --max-bits-per-weight B)
             [--backend litert|xla|both] [--out rules.yaml]
  odmlq inspect model.tflite
  odmlq ops                              what each op kind becomes on LiteRT, per schema
  odmlq diff model.tflite --inputs in.npz --device-tensors dump.npz [--min-sqnr 30]
             [--model module:function [--rules R] [--calibration C.npz]] [--json] [--html out.html]
             [--model-explorer out.json]

A SAMPLE is one of the bundled sample models (``odmlq plan --list``). A
``module:function`` names a function that takes no arguments and returns
``(model, example_inputs, variables)`` (variables may be None for NNX).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from odmlq.errors import OdmlqError

DEFAULT_RULES = "int8 weights (per-channel) and int8 activations everywhere"


# The repository's samples are loaded by name, as any user's module:function
# is: odmlq itself never depends on them (an installed odmlq may lack them).
SAMPLES_MODULE = "samples.models"
DEMO_MODULE = "samples.digits_cnn"


def _samples() -> dict:
    try:
        return importlib.import_module(SAMPLES_MODULE).SAMPLES
    except ImportError:  # an installed odmlq without the repository's samples/
        return {}


def _load_model(target: str):
    samples = _samples()
    if target in samples:
        return samples[target]()
    if ":" not in target:
        raise OdmlqError(
            f"Unknown model {target!r}: give a sample ({', '.join(sorted(samples)) or 'none installed'}) "
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


def _cmd_plan(args) -> int:
    from odmlq.targets import plan

    model, inputs, variables = _load_model(args.model)
    rules = _rules_from(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(model, rules, *inputs, variables=variables)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(p.to_json() if args.json else p)
    return 0


def _rules_from(args):
    from odmlq.rules import Rule, load_rules

    if args.rules:
        return load_rules(args.rules)
    print(f"# no --rules given: {DEFAULT_RULES}", file=sys.stderr)
    return [Rule(".*", weight_qtype="int8", act_qtype="int8")]


def _cmd_export(args) -> int:
    from odmlq.calibration import Calibration
    from odmlq.litert.export import export_tflite

    model, inputs, variables = _load_model(args.model)
    calibration = Calibration.load(args.calibration) if args.calibration else None
    data = _load_batches(args.data, args.batch_size, "--data") if args.data else None
    if data is None and calibration is None:
        raise OdmlqError("odmlq export needs --calibration C.npz or --data D.npz (representative inputs).")
    result = export_tflite(model, _rules_from(args), data or [tuple(inputs)], args.out,
                           variables=variables, example_inputs=inputs, calibration=calibration,
                           verify=not args.no_verify, allow_float_ops=args.allow_float_ops)
    print(result)
    return 0


def _load_batches(path: str, batch_size: int, what: str) -> list[tuple]:
    """Batches of `batch_size` rows of an .npz holding one array per model input."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = [f[k] for k in f.files]
    except (OSError, ValueError) as e:
        raise OdmlqError(f"Cannot read {what} {path!r}: {e}.") from None
    if not arrays:
        raise OdmlqError(f"{what} {path!r} holds no arrays.")
    if batch_size < 1:
        raise OdmlqError(f"--batch-size {batch_size} must be at least 1.")
    n = len(arrays[0])
    return [tuple(a[i:i + batch_size] for a in arrays) for i in range(0, n, batch_size)]


def _cmd_tune(args) -> int:
    from odmlq.files import check_output_path
    from odmlq.report.tune import TuneTarget, autotune

    target = TuneTarget(min_sqnr_db=args.min_sqnr, min_cosine=args.min_cosine,
                        max_bits_per_weight=args.max_bits_per_weight, max_bytes=args.max_bytes)
    if args.out:
        check_output_path(args.out)
    data = _load_batches(args.data, args.batch_size, "--data")
    evaluation = _load_batches(args.eval_data, args.batch_size, "--eval-data") if args.eval_data else None
    model, inputs, variables = _load_model(args.model)
    candidates = [c for c in args.candidates.split(",") if c] if args.candidates else None
    result = autotune(model, variables, data, target=target, eval_inputs=evaluation, candidates=candidates,
                      backend=args.backend, example_inputs=inputs, max_trials=args.max_trials,
                      check=not args.no_check, progress=False if args.quiet else None)
    print(result)
    if args.out:
        result.save_rules(args.out)
        print(f"# wrote {args.out}", file=sys.stderr)
    if not result.met:
        print("odmlq: the target is not met; the rules above are the closest measured", file=sys.stderr)
        return 3
    return 0


def _cmd_inspect(args) -> int:
    from odmlq.litert.inspect import inspect

    print(inspect(args.model))
    return 0


def _cmd_diff(args) -> int:
    import numpy as np

    from odmlq.litert.device import check_model_inputs, diff_device
    from odmlq.report import device_report

    def load(path, what):
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except (OSError, ValueError) as e:
            raise OdmlqError(f"Cannot read {what} {path!r}: {e}.") from None

    try:
        with open(args.model, "rb") as f:
            tflite = f.read()
    except OSError as e:
        raise OdmlqError(f"Cannot read model {args.model!r}: {e.strerror}.") from None
    if (args.rules or args.calibration) and not args.float_model:
        raise OdmlqError("--rules and --calibration describe the model given with --model module:function; "
                         "add --model.")
    inputs = load(args.inputs, "--inputs")
    dump = load(args.device_tensors, "--device-tensors")
    result = diff_device(tflite, inputs, dump)
    if args.model_explorer and (not args.float_model or result.outputs_only):
        raise OdmlqError("--model-explorer needs --model (and --calibration) and a .tflite odmlq exported: "
                         "the device's SQNR is measured per edge of its plan.")
    model = variables = plan = scales = None
    if args.float_model:
        model, example_inputs, variables = _load_model(args.float_model)
        check_model_inputs(list(inputs), list(inputs.values()), example_inputs)
        if not result.outputs_only:
            plan, scales = _plan_and_scales(args, model, example_inputs, variables)
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
        _write_html(args.html, report)
    if args.model_explorer:
        report.save_model_explorer(args.model_explorer, tflite, plan=plan, scales=scales, metric="device")
        print(f"# wrote {args.model_explorer}", file=sys.stderr)
    if args.min_sqnr is not None and result.output_sqnr_db < args.min_sqnr:
        print(f"odmlq: outputs at {result.output_sqnr_db:.1f} dB, under --min-sqnr {args.min_sqnr:g}",
              file=sys.stderr)
        return 3
    return 0


def _plan_and_scales(args, model, example_inputs, variables):
    """The plan and scales an odmlq .tflite was exported with, from --rules and --calibration."""
    from odmlq.graph import params_for
    from odmlq.calibration import Calibration
    from odmlq.targets import plan as make_plan
    from odmlq.scales import compute_scales

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = make_plan(model, _rules_from(args), *example_inputs, variables=variables)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    static = any(e.spec is not None and not e.spec.dynamic for e in p.edges.values())
    if static and not args.calibration:
        raise OdmlqError("odmlq diff --model needs --calibration C.npz for a model with calibrated "
                         "activations: the statistics the .tflite was exported with (Calibration.save).")
    calibration = Calibration.load(args.calibration) if args.calibration else None
    return p, compute_scales(p, calibration, params_for(model, variables, "odmlq diff"))


def _write_html(path: str, report) -> None:
    """The report as one HTML page, written atomically."""
    report.save_html(path)
    print(f"# wrote {path}", file=sys.stderr)


def _cmd_ops(args) -> int:
    from odmlq.litert import coverage

    print(coverage.markdown(), end="")
    return 0


def _cmd_demo(args) -> int:
    try:
        digits_cnn = importlib.import_module(DEMO_MODULE)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] != "samples":
            raise OdmlqError(f"odmlq demo needs the package {e.name!r}, which is not installed; "
                             "reinstall odmlq (python -m pip install -e .).") from None
        raise OdmlqError("odmlq demo needs the repository's samples/ (install odmlq from a checkout).") from None
    digits_cnn.main(args.out, args.seconds)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="odmlq", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="trace a model and print what each op and edge becomes")
    p.add_argument("model", nargs="?", help="a sample name, or module:function")
    p.add_argument("--rules", help="rules file (YAML or JSON)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list", action="store_true", help="list the bundled samples")
    d = sub.add_parser("demo", help="train the digits CNN, export int8 LiteRT, compare with float")
    d.add_argument("--out", default="out", help="directory for the .tflite files (default: out)")
    d.add_argument("--seconds", type=float, default=5.0, help="training time budget")
    e = sub.add_parser("export", help="export a model to a verified .tflite")
    e.add_argument("model", help="module:function returning (model, example_inputs, variables)")
    e.add_argument("--out", required=True, help="the .tflite to write")
    e.add_argument("--rules", help="rules file (YAML or JSON)")
    e.add_argument("--calibration", help="calibration statistics (.npz from Calibration.save)")
    e.add_argument("--data", help=".npz of representative inputs (one array per model input)")
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--no-verify", action="store_true", help="skip the op-by-op check")
    e.add_argument("--allow-float-ops", action="store_true")
    t = sub.add_parser("tune", help="find rules that meet an accuracy floor or a size budget (autotune)")
    t.add_argument("model", help="a sample name, or module:function returning (model, example_inputs, variables)")
    t.add_argument("--data", required=True, help=".npz of representative inputs (one array per model input)")
    t.add_argument("--eval-data", help=".npz of inputs the accuracy is measured on (default: --data)")
    t.add_argument("--batch-size", type=int, default=32, help="rows per batch of --data (default 32)")
    t.add_argument("--min-sqnr", type=float, help="every output's SQNR against float at least this (dB)")
    t.add_argument("--min-cosine", type=float, help="mean per-sample cosine against float at least this")
    t.add_argument("--max-bits-per-weight", type=float, help="average stored bits per weight at most this")
    t.add_argument("--max-bytes", type=int, help="parameters' stored bytes at most this")
    t.add_argument("--backend", choices=("litert", "xla", "both"), default="litert",
                   help="whose kernels the rules must run on (default litert)")
    t.add_argument("--candidates", help="comma-separated precisions to choose among "
                                        "(float,int16x8,int8,int4,w8,w4,w2; default by backend and target)")
    t.add_argument("--max-trials", type=int, default=8, help="configurations measured at most (default 8)")
    t.add_argument("--no-check", action="store_true",
                   help="skip exporting/running the chosen rules on the backend(s)")
    t.add_argument("--out", help="write the chosen rules here (YAML, for --rules)")
    t.add_argument("--quiet", action="store_true", help="no progress lines")
    sub.add_parser("ops", help="what each op kind becomes on LiteRT, per schema (docs/OPS.md)")
    i = sub.add_parser("inspect", help="ops, quantization and float islands of a .tflite")
    i.add_argument("model", help="the .tflite file")
    f = sub.add_parser("diff", help="compare tensors dumped on a device with the host interpreter")
    f.add_argument("model", help="the .tflite file")
    f.add_argument("--inputs", required=True, help=".npz with one array per model input, in order")
    f.add_argument("--device-tensors", required=True,
                   help=".npz of tensors dumped on the device (samples/dump_tensors.py)")
    f.add_argument("--min-sqnr", type=float, help="exit 3 when the outputs' SQNR is under this (dB)")
    f.add_argument("--model", dest="float_model", metavar="MODULE:FUNCTION",
                   help="the float model (a sample or module:function) to compare every edge with "
                        "float and simulate; outputs only for a .tflite odmlq did not make")
    f.add_argument("--rules", help="rules file the .tflite was exported with (with --model)")
    f.add_argument("--calibration", help="calibration statistics it was exported with (with --model)")
    f.add_argument("--json", action="store_true", help="print the report as JSON (odmlq.report version 2)")
    f.add_argument("--html", metavar="OUT.html", help="write the report as one HTML page")
    f.add_argument("--model-explorer", metavar="OUT.json",
                   help="write the device's SQNR per op as Model Explorer node data (with --model)")
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            if args.list or not args.model:
                print("samples: " + ", ".join(sorted(_samples())))
                return 0 if args.list else 2
            return _cmd_plan(args)
        commands = {"demo": _cmd_demo, "export": _cmd_export, "inspect": _cmd_inspect, "diff": _cmd_diff,
                    "ops": _cmd_ops, "tune": _cmd_tune}
        return commands[args.command](args)
    except OdmlqError as e:
        print(f"odmlq: error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
