"""The `odmlq` command line.

  odmlq plan SAMPLE|module:function [--rules rules.yaml] [--json]

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


def _samples() -> dict:
    try:
        from samples.models import SAMPLES
    except ImportError:  # an installed odmlq without the repository's samples/
        return {}
    return SAMPLES


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
    from odmlq.plan import plan
    from odmlq.rules import Rule, load_rules

    model, inputs, variables = _load_model(args.model)
    if args.rules:
        rules = load_rules(args.rules)
    else:
        rules = [Rule(".*", weight_qtype="int8", act_qtype="int8")]
        print(f"# no --rules given: {DEFAULT_RULES}", file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(model, rules, *inputs, variables=variables)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(p.to_json() if args.json else p)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="odmlq", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="trace a model and print what each op and edge becomes")
    p.add_argument("model", nargs="?", help="a sample name, or module:function")
    p.add_argument("--rules", help="rules file (YAML or JSON)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list", action="store_true", help="list the bundled samples")
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            if args.list or not args.model:
                print("samples: " + ", ".join(sorted(_samples())))
                return 0 if args.list else 2
            return _cmd_plan(args)
    except OdmlqError as e:
        print(f"odmlq: error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
