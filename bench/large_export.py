"""A LiteRT export of a model with more than 2 GB of float weights.

An MLP of `--layers` dense layers `--width` wide (by default 9 x 8192 x 8192:
604M parameters, 2.42 GB of float32) is exported int8 (dynamic-range by
default: int8 weights, inputs quantized by the kernels) to a .tflite. Its
quantized weights pass 1 GiB, so the export hands them to the converter as
placeholders and writes their integers after the flatbuffer
(`export_tflite(external_weights=)`, see odmlq/litert/_external.py).

Measured, each in the same process, peak resident memory reset between steps
(``/proc/self/clear_refs``):

- the export without verification: its peak RSS above the process before it,
  against the float weights' bytes (the placeholders keep the weights out of
  the StableHLO text and the converter);
- verification against simulate (which computes with the weights on the grid,
  a float copy);
- the written file loaded from its path in LiteRT and run on XNNPACK (one
  thread): partitions, latency, output SQNR against the float model.

    python -m bench.large_export [--width 8192] [--layers 9] [--schema dynamic|int8]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np
from ai_edge_litert import schema_py_generated as schema

import odmlq
from odmlq.litert._samples import verification_samples
from odmlq.litert.verify import verify


class MLP(nn.Module):
    width: int
    layers: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers - 1):
            x = nn.relu(nn.Dense(self.width, name=f"dense{i}")(x))
        return nn.Dense(self.width, name="head")(x)


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _params(width: int, layers: int, seed: int = 0) -> dict:
    """He-initialized float32 weights, made one layer at a time in numpy."""
    rng = np.random.default_rng(seed)
    params = {}
    for i in range(layers):
        name = f"dense{i}" if i < layers - 1 else "head"
        kernel = rng.standard_normal((width, width), np.float32)
        kernel *= np.float32(np.sqrt(2.0 / width))
        params[name] = {"kernel": kernel, "bias": (0.01 * rng.standard_normal(width)).astype(np.float32)}
    return {"params": params}


def _sqnr(reference, value) -> float:
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((value - reference) ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--schema", choices=["dynamic", "int8"], default="dynamic")
    parser.add_argument("--out", default=None, help="directory for the .tflite (default: a temporary one)")
    args = parser.parse_args()
    model = MLP(args.width, args.layers)
    variables = _params(args.width, args.layers)
    float_bytes = sum(v.nbytes for v in jax.tree.leaves(variables))
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((4, args.width)).astype(np.float32) for _ in range(3)]
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=args.schema == "dynamic",
                        weight_algorithm="nearest")]
    print(f"MLP {args.layers} x {args.width} x {args.width}: {float_bytes / 2**30:.2f} GiB of float32 weights; "
          f"{args.schema} int8, round to nearest")
    directory = args.out or tempfile.mkdtemp(prefix="odmlq-large-")
    path = os.path.join(directory, "large.tflite")
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    result = odmlq.export_tflite(model, rules, batches, path, variables=variables, verify=False, progress=False)
    export_s = time.perf_counter() - start
    export_peak = _status("VmHWM")
    size = os.path.getsize(path)
    model_file = schema.Model.GetRootAsModel(result.tflite, 0)
    after = [model_file.Buffers(b) for b in range(model_file.BuffersLength()) if model_file.Buffers(b).Offset() > 1]
    flatbuffer = min(b.Offset() for b in after) if after else size
    print(f"export: {export_s:.0f} s; file {size / 2**20:,.0f} MiB: a {flatbuffer / 2**10:,.0f} KiB flatbuffer, then "
          f"{len(after)} weights ({sum(b.Size() for b in after) / 2**20:,.0f} MiB) after it")
    print(f"  RSS before {before:,.0f} MiB, peak {export_peak:,.0f} MiB: {export_peak - before:,.0f} MiB above "
          f"(float weights {float_bytes / 2**20:,.0f} MiB, int8 file {size / 2**20:,.0f} MiB)")
    gc.collect()
    _reset_peak()
    start = time.perf_counter()
    report = verify(result.tflite, model, result.plan, result.scales,
                    verification_samples([batches[-1]], 4), variables=variables, min_output_sqnr_db=30.0)
    print(f"verification: {'passed' if report.passed else 'FAILED'} in {time.perf_counter() - start:.0f} s, "
          f"peak {_status('VmHWM'):,.0f} MiB")
    delegation = result.delegation
    del result
    gc.collect()
    runner = odmlq.litert.interpreter(path, num_threads=1)
    signature = runner.get_signature_runner()
    name = next(iter(signature.get_input_details()))
    x = batches[0][:1]
    out = next(iter(signature(**{name: x}).values()))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        signature(**{name: x})
        times.append(time.perf_counter() - start)
    reference = np.asarray(model.apply(variables, x))
    print(f"LiteRT from the path: {np.median(times) * 1e3:.1f} ms per row (1 thread), "
          f"output SQNR vs float {_sqnr(reference, out):.1f} dB; {delegation}")


if __name__ == "__main__":
    main()
