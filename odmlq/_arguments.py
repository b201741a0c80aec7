"""The grammar of the `odmlq` command line (argparse): commands, options, help.

`odmlq.cli` runs the commands; this module only describes them, so it imports
nothing but argparse.
"""

from __future__ import annotations

import argparse

__all__ = ["parser"]

_MODEL = "a sample name (odmlq plan --list) or module:function returning (model, example_inputs, variables)"
_RULES = "rules file, YAML or JSON (default: int8 weights per channel and int8 activations everywhere)"
_DATA = ".npz of representative inputs, one array per model input, rows first (numpy.savez)"
_BATCH = "rows of --data per calibration batch (default 32)"
_QUIET = "no progress on stderr (it is shown only when stderr is a terminal anyway)"


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="train the digits CNN, export int8 LiteRT, compare with float")
    d.add_argument("--out", default="out", help="directory for the .tflite files (default: out)")
    d.add_argument("--seconds", type=float, default=5.0,
                   help="training time budget, compilation included (default 5)")


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="trace a model and print what each op and edge becomes")
    p.add_argument("model", nargs="?", help=_MODEL)
    p.add_argument("--rules", help=_RULES)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list", action="store_true", help="list the bundled samples")


def _export_parser(sub) -> None:
    e = sub.add_parser("export", help="export a model to a verified .tflite")
    e.add_argument("model", help=_MODEL)
    e.add_argument("--out", required=True, help="the .tflite to write (replaced only by a complete new file)")
    e.add_argument("--rules", help=_RULES)
    e.add_argument("--data", help=_DATA + "; the last batch is held back to verify")
    e.add_argument("--calibration", help="calibration statistics to use instead of calibrating on --data "
                                         "(.npz from --save-calibration or Calibration.save)")
    e.add_argument("--save-calibration", metavar="C.npz",
                   help="write the calibration statistics used (for odmlq diff/compare --calibration)")
    e.add_argument("--batch-size", type=int, default=32, help=_BATCH)
    e.add_argument("--no-verify", action="store_true",
                   help="skip running the .tflite in LiteRT and checking every op against simulate")
    e.add_argument("--allow-float-ops", action="store_true",
                   help="let ops without an integer LiteRT kernel stay in float (listed and warned about) "
                        "instead of refusing the export")
    e.add_argument("--require-delegate", action="store_true",
                   help="refuse the export when any op runs outside XNNPACK (named in the error)")
    e.add_argument("--benchmark", action=argparse.BooleanOptionalAction, default=None,
                   help="time the export against its float twin (on 1 and 2 threads) and warn when it is "
                        "slower; default: when the float weights are at most 32 MiB")
    weights = e.add_mutually_exclusive_group()
    weights.add_argument("--external-weights", dest="external_weights", action="store_true", default=None,
                         help="store the quantized weights after the flatbuffer (files past 2 GB; "
                              "default: when they pass 1 GiB in float32)")
    weights.add_argument("--inline-weights", dest="external_weights", action="store_false",
                         help="store every weight inside the flatbuffer")
    e.add_argument("--quiet", action="store_true", help=_QUIET)


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="quantize by the rules and compare every edge with float "
                                       "(simulate, and LiteRT/XLA when asked)")
    c.add_argument("model", help=_MODEL)
    c.add_argument("--data", required=True, help=_DATA + "; calibrates when --calibration is not given")
    c.add_argument("--rules", help=_RULES)
    c.add_argument("--calibration", help="calibration statistics to use instead of calibrating on --data")
    c.add_argument("--eval-data", help=".npz of inputs to compare on (default: the first rows of --data)")
    c.add_argument("--rows", type=int, default=32, help="rows compared (default 32)")
    c.add_argument("--batch-size", type=int, default=32, help=_BATCH)
    c.add_argument("--litert", action="store_true", help="export a .tflite now and add its run (batch 1)")
    c.add_argument("--tflite", help="add the run of this .tflite (exported from the same rules and calibration)")
    c.add_argument("--xla", action="store_true", help="add the run of odmlq.ptq's quantized XLA model")
    c.add_argument("--try-fixes", action="store_true",
                   help="measure each piece of advice: re-plan with its rule, outputs against float")
    c.add_argument("--min-sqnr", type=float, help="exit 3 when an output's SQNR is under this (dB)")
    c.add_argument("--json", action="store_true", help="print the report as JSON (odmlq.report version 2)")
    c.add_argument("--html", metavar="OUT.html", help="write the report as one HTML page")
    c.add_argument("--model-explorer", metavar="OUT.json",
                   help="write each op's SQNR as Model Explorer node data (with --litert or --tflite)")
    c.add_argument("--save-calibration", metavar="C.npz", help="write the calibration statistics used")
    c.add_argument("--quiet", action="store_true", help=_QUIET)


def _tune_parser(sub) -> None:
    t = sub.add_parser("tune", help="find rules that meet an accuracy floor, a size or a latency budget (autotune)")
    t.add_argument("model", help=_MODEL)
    t.add_argument("--data", required=True, help=_DATA)
    t.add_argument("--eval-data", help=".npz of inputs the accuracy is measured on (default: --data)")
    t.add_argument("--batch-size", type=int, default=32, help=_BATCH)
    t.add_argument("--min-sqnr", type=float, help="every output's SQNR against float at least this (dB)")
    t.add_argument("--min-cosine", type=float, help="mean per-sample cosine against float at least this")
    t.add_argument("--max-bits-per-weight", type=float, help="average stored bits per weight at most this")
    t.add_argument("--max-bytes", type=int, help="parameters' stored bytes at most this")
    t.add_argument("--max-latency-ratio", type=float,
                   help="latency at most this times the float model's on the backend (timed in the same "
                        "rounds; on LiteRT a group stays quantized only where XNNPACK runs it)")
    t.add_argument("--max-latency-ms", type=float, help="latency on the backend at most this (ms, this machine)")
    t.add_argument("--backend", choices=("litert", "xla", "both"), default="litert",
                   help="whose kernels the rules must run on (default litert)")
    t.add_argument("--candidates", help="comma-separated precisions to choose among "
                                        "(float,int16x8,int8,int4,w8,w4,w2; default by backend and target)")
    t.add_argument("--max-trials", type=int, default=8, help="configurations measured at most (default 8)")
    t.add_argument("--no-check", action="store_true",
                   help="skip exporting/running the chosen rules on the backend(s)")
    t.add_argument("--out", help="write the chosen rules here (YAML, for --rules)")
    t.add_argument("--quiet", action="store_true", help=_QUIET)


def _diff_parser(sub) -> None:
    f = sub.add_parser("diff", help="compare tensors dumped on a device with the host interpreter")
    f.add_argument("model", help="the .tflite file the device ran")
    f.add_argument("--inputs", required=True, help=".npz with one array per model input, in order")
    f.add_argument("--device-tensors", required=True,
                   help=".npz of tensors dumped on the device (samples/dump_tensors.py)")
    f.add_argument("--min-sqnr", type=float, help="exit 3 when the outputs' SQNR is under this (dB)")
    f.add_argument("--model", dest="float_model", metavar="MODEL",
                   help="the float model (a sample or module:function) to compare every edge with "
                        "float and simulate; outputs only for a .tflite odmlq did not make")
    f.add_argument("--rules", help="rules file the .tflite was exported with (with --model)")
    f.add_argument("--calibration", help="calibration statistics it was exported with (with --model; "
                                         "odmlq export --save-calibration)")
    f.add_argument("--json", action="store_true", help="print the report as JSON (odmlq.report version 2)")
    f.add_argument("--html", metavar="OUT.html", help="write the report as one HTML page")
    f.add_argument("--model-explorer", metavar="OUT.json",
                   help="write the device's SQNR per op as Model Explorer node data (with --model)")


def parser(description: str) -> argparse.ArgumentParser:
    """The `odmlq` command line: every command, its options and their help."""
    top = argparse.ArgumentParser(prog="odmlq", description=description,
                                  epilog="odmlq COMMAND --help describes each command.")
    top.add_argument("--verbose", action="store_true",
                     help="keep LiteRT's own log lines (its INFO lines are dropped by default)")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_demo_parser, _plan_parser, _export_parser, _compare_parser, _tune_parser, _diff_parser):
        add(sub)
    sub.add_parser("ops", help="what each op kind becomes on LiteRT, per schema (docs/OPS.md)")
    i = sub.add_parser("inspect", help="ops, quantization, float islands and XNNPACK delegation of a .tflite")
    i.add_argument("model", help="the .tflite file")
    for command in sub.choices.values():  # also after the command's name (SUPPRESS keeps the top one's value)
        command.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="keep LiteRT's own log lines")
    return top
