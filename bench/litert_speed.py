"""LiteRT speed of every schema against float: partitions, bytes, latency ratios.

For the digits CNN (trained, as bench/accuracy.py trains it), the 25M-parameter
MLP (1024-4096-4096-1024) and MiniLM (when its wheel is installed), each
schema is exported by odmlq at batch 1 and at batch 32:

- float; int8 (full integer; MiniLM: the sample's int8 rules, int8 matmuls
  with the rest float on XNNPACK, and its int8+int16 rules); int8 with float
  outputs (``odmlq.INT8``: the output op a dynamic-range kernel); int16x8;
  dynamic int8 (int8 weights, inputs quantized by the kernels);
- int4 weights per channel, weight-only and with dynamic int8 inputs;
- int4 in blocks of 128 (32 on the digits CNN, whose head has 64 inputs)
  with dynamic int8 inputs (XNNPACK's blockwise kernel); convolutions stay int8 in the dynamic int4 schemas (LiteRT's
  hybrid convolutions read int8 filters only).

All files of one model and batch size are timed in the same interleaved
rounds, on one thread and on two. The table gives bytes, XNNPACK partitions,
the ops left on LiteRT's reference kernels, output SQNR against the float
JAX model on 32 held-out rows, median ms per invoke and the ratio to the
float file. Exports are not verified here (the tests verify
every schema); only where the ops run and how fast is measured.

Run: python bench/litert_speed.py [--models cnn,mlp25m,minilm] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import odmlq  # noqa: E402
from odmlq.timing import balanced_orders  # noqa: E402
from accuracy import digits, minilm, mlp25m  # noqa: E402  (bench/accuracy.py: the same models)

R = odmlq.Rule
BATCHES = (1, 32)
THREADS = (1, 2)


def schemas(bench) -> dict[str, list]:
    """Schema name -> rules for `bench` (MiniLM keeps its embeddings and LayerNorms float)."""
    keep = [R(bench.float_modules, skip=True)] if bench.float_modules else []
    if bench.name == "minilm":
        from samples.minilm_tflite import SCHEMAS as SAMPLE

        fixed = {"int8": SAMPLE["int8"], "int8+int16": SAMPLE["int8+int16"], "int16x8": SAMPLE["int16x8"],
                 "dynamic int8": SAMPLE["dynamic"]}
    else:
        fixed = {"int8": list(odmlq.FULL_INTEGER_INT8), "int8, float outputs": list(odmlq.INT8),
                 "int16x8": [R(".*", weight_qtype="int8", act_qtype="int16")],
                 "dynamic int8": [R(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]}
    # LiteRT's hybrid convolutions read int8 filters: int4 goes to the matmuls.
    # Blocks of 128, or 32 where a matmul has fewer inputs (the digits CNN's head: 64).
    block = 32 if bench.name.startswith("digits") else 128
    convs = [R(".*", op="conv", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    return {"float": [], **fixed,
            "int4 weight-only": keep + [R(".*", weight_qtype="int4")],
            "int4 dynamic": keep + convs + [R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True)],
            f"int4 b{block} dynamic": keep + convs + [R(".*", weight_qtype="int4", act_qtype="int8", act_dynamic=True,
                                                        weight_granularity=odmlq.PerBlock(block))]}


def example(bench, batch: int) -> tuple:
    """`batch` rows of the held-out inputs (they have 32 or more)."""
    return tuple(np.asarray(x)[:batch] for x in bench.held_out[0])


def sqnr_db(bench, tflite: bytes, batch: int) -> float:
    """Output SQNR (dB) of the file against the float model on the 32 held-out rows, `batch` per invoke."""
    rows = example(bench, 32)
    reference = np.asarray(bench.model.apply(bench.variables, *rows), np.float64)
    runner = odmlq.litert.interpreter(tflite, num_threads=1)
    details, out = runner.get_input_details(), runner.get_output_details()[0]
    outputs = []
    for start in range(0, 32, batch):
        for detail, x in zip(details, rows):
            runner.set_tensor(detail["index"], x[start:start + batch].astype(detail["dtype"]))
        runner.invoke()
        outputs.append(np.asarray(runner.get_tensor(out["index"]), np.float64))
    noise = np.sum((np.concatenate(outputs) - reference) ** 2)
    return float(10 * np.log10(np.sum(reference ** 2) / noise)) if noise > 0 else float("inf")


def export_all(bench, batch: int) -> dict[str, object]:
    """Schema -> (Export, what its warnings said), or the refusal's message."""
    out: dict[str, object] = {}
    for name, rules in schemas(bench).items():
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                export = odmlq.export_tflite(bench.model, rules, bench.calibration, variables=bench.variables,
                                             example_inputs=example(bench, batch), verify=False,
                                             allow_float_ops=True, progress=False)
            out[name] = (export, said(export, [str(w.message) for w in caught]))
        except odmlq.OdmlqError as error:
            out[name] = str(error).split("; ")[0].split(". ")[0]
        print(f"# {bench.name} batch {batch} {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr,
              flush=True)
    return out


def said(export, messages: list[str]) -> str:
    """What the export told its user about speed: a warning that it is (or may
    be) slower than float, and its own measurement where it timed itself."""
    words = []
    if any("runs slower than its float twin on this machine" in m for m in messages):
        words.append("warned: measured slower")
    elif any("not reliably faster than its float twin" in m for m in messages):
        words.append("warned: not reliably faster")
    if any("run outside XNNPACK" in m for m in messages):
        words.append("warned: ops off XNNPACK")
    if export.latencies:
        words.append("measured " + "/".join(f"{x.vs_float:.2f}x ({x.slower_rounds}/{x.rounds})"
                                            for x in export.latencies))
    return "; ".join(words) or "-"


def main(models: list[str], rounds: int) -> None:
    makers = {"cnn": lambda: digits("cnn"), "mlp25m": mlp25m, "minilm": minilm}
    print("| model | schema | batch | bytes | SQNR dB vs float | XNNPACK partitions | ops outside XNNPACK | "
          "ms, 1 thread | vs float | ms, 2 threads | vs float | the export says |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    unwarned = []
    for key in models:
        bench = makers[key]()
        if bench is None:
            print(f"| {key} | not installed (see README) | | | | | | | | | | |")
            continue
        for batch in BATCHES:
            exports = export_all(bench, batch)
            made = {n: e[0] for n, e in exports.items() if not isinstance(e, str)}
            inputs = [x for x in example(bench, batch)]
            # Microsecond models: as many invokes as take 20 ms a round (interleaved_latency's default),
            # and at least a whole cycle of orders in which each file follows every other one equally
            # often (another interpreter's threads still spinning slow the next one down).
            tiny = bench.name.startswith("digits")
            invokes = None if tiny else 10 if batch == 1 else 3
            timed_rounds = max(rounds, len(balanced_orders(len(made)))) if tiny else rounds
            ms = {threads: dict(zip(made, odmlq.litert.interleaved_latency(
                [e.tflite for e in made.values()], inputs, rounds=timed_rounds, invokes=invokes, num_threads=threads)))
                for threads in THREADS}
            for name, e in exports.items():
                if isinstance(e, str):
                    print(f"| {bench.name} | {name} | {batch} | refused: {e} | | | | | | | | |")
                    continue
                e, words = e
                outside = e.delegation.outside
                kinds = sorted({op.name for op in outside})
                listing = f"{len(outside)}" + (f" ({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''})"
                                               if outside else "")
                cells = [f"{ms[t][name]:.3f} | {ms[t][name] / ms[t]['float']:.2f}" for t in THREADS]
                sqnr = "-" if name == "float" else f"{sqnr_db(bench, e.tflite, batch):.1f}"
                print(f"| {bench.name} | {name} | {batch} | {len(e.tflite):,} | {sqnr} | {e.delegation.partitions} | "
                      f"{listing} | {' | '.join(cells)} | {words} |", flush=True)
                slower = [t for t in THREADS if ms[t][name] > ms[t]["float"]]
                if name != "float" and slower and not words.startswith("warned"):
                    unwarned.append(f"{bench.name} {name} batch {batch} ({', '.join(f'{t} thread' for t in slower)})")
    print(f"\nRows slower than float here without a warning from the export: {len(unwarned)}"
          + (": " + "; ".join(unwarned) if unwarned else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,mlp25m,minilm")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    main(args.models.split(","), args.rounds)
