"""The commands that make things: plan, export, tune, inspect, ops, demo."""

from __future__ import annotations

import importlib
import sys

from odmlq.cli._inputs import (load_batches, load_calibration, load_model, rules_from, warnings_on_stderr,
                               writable)
from odmlq.errors import OdmlqError

DEMO_MODULE = "samples.digits_cnn"


def progress_of(args) -> bool | None:
    """--quiet: no progress; otherwise shown where stderr is a terminal."""
    return False if getattr(args, "quiet", False) else None


def plan(args) -> int:
    from odmlq.targets import plan as make_plan

    rules = rules_from(args.rules)
    model, inputs, variables = load_model(args.model)
    with warnings_on_stderr():
        p = make_plan(model, rules, *inputs, variables=variables)
    print(p.to_json() if args.json else p)
    return 0


def export(args) -> int:
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
                               allow_float_ops=args.allow_float_ops, progress=progress_of(args))
    print(result)
    if args.save_calibration:
        if result.calibration is None:
            print(f"# {args.save_calibration} not written: these rules calibrate no activation "
                  "(dynamic, weight-only or float)", file=sys.stderr)
        else:
            result.calibration.save(args.save_calibration)
            print(f"# wrote {args.save_calibration}", file=sys.stderr)
    return 0


def tune(args) -> int:
    from odmlq.report.tune import TuneTarget, autotune, parse_candidates

    target = TuneTarget(min_sqnr_db=args.min_sqnr, min_cosine=args.min_cosine,
                        max_bits_per_weight=args.max_bits_per_weight, max_bytes=args.max_bytes)
    writable(args.out)
    data = load_batches(args.data, args.batch_size, "--data")
    evaluation = load_batches(args.eval_data, args.batch_size, "--eval-data") if args.eval_data else None
    candidates = parse_candidates([c for c in args.candidates.split(",") if c]) if args.candidates else None
    model, inputs, variables = load_model(args.model)
    result = autotune(model, variables, data, target=target, eval_inputs=evaluation, candidates=candidates,
                      backend=args.backend, example_inputs=inputs, max_trials=args.max_trials,
                      check=not args.no_check, progress=progress_of(args))
    print(result)
    if args.out:
        result.save_rules(args.out)
        print(f"# wrote {args.out}", file=sys.stderr)
    if not result.met:
        print("odmlq: the target is not met; the rules above are the closest measured", file=sys.stderr)
        return 3
    return 0


def inspect(args) -> int:
    from odmlq.litert.inspect import inspect as inspect_model

    print(inspect_model(args.model))
    return 0


def ops(args) -> int:
    from odmlq.litert import coverage

    print(coverage.markdown(), end="")
    return 0


def demo(args) -> int:
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
