"""Where an exported model runs, and how fast: XNNPACK delegation and latency.

LiteRT hands the ops XNNPACK can run to its delegate, in partitions (one
DELEGATE node each); every other op runs on LiteRT's reference kernels, and
each change between the two costs a hand-over. A quantized model whose
matmuls or convolutions fall off the delegate (int16x8 convolutions,
dynamic-range convolutions, an op XNNPACK has no quantized kernel for) is
often slower than its float twin, which XNNPACK runs whole.

`delegation` reads it from the interpreter itself, not from a table of what
XNNPACK supports: the tensors inside a partition are never allocated, so an
op is delegated when each of its outputs is either unallocated or an output
of a DELEGATE node. `interleaved_latency` times several models in the same
rounds, so they share the machine's state.

Example:
  >>> found = odmlq.litert.delegation(tflite, odmlq.litert.inspect(tflite))
  >>> found.partitions, [op.name for op in found.outside]
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence

import numpy as np

from odmlq.errors import OdmlqError
from odmlq.litert._runtime import interpreter
from odmlq.litert.inspect import ModelSummary, OpInfo
from odmlq.plan import named_list
from odmlq.timing import interleaved_ms, interleaved_rounds

__all__ = ["AUTO_BENCHMARK_BYTES", "COMPUTE_OPS", "Delegation", "DelegateError", "Latency", "benchmark_threads",
           "check_delegation", "delegation", "interleaved_latency", "slower_than_float", "timed_against_float"]

# The ops that carry a model's arithmetic: off the delegate, they decide its speed.
COMPUTE_OPS = frozenset({"CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV", "CONV_3D", "FULLY_CONNECTED",
                         "BATCH_MATMUL"})


class DelegateError(OdmlqError, ValueError):
    """An export asked to run whole on the delegate has ops outside it."""


@dataclasses.dataclass(frozen=True)
class Delegation:
    """How LiteRT's default delegate (XNNPACK) takes a model.

    Attributes:
      partitions: DELEGATE nodes (the graph runs in this many XNNPACK pieces).
      delegated: ops of the model that run inside a partition.
      outside: ops that run on LiteRT's reference kernels, in model order.
    """

    partitions: int
    delegated: int
    outside: tuple[OpInfo, ...]

    @property
    def compute_outside(self) -> tuple[OpInfo, ...]:
        """The matmuls and convolutions among `outside`."""
        return tuple(op for op in self.outside if op.name in COMPUTE_OPS)

    def describe_outside(self, limit: int = 8) -> str:
        """'CONV_2D (module 'a/b'), ...': the first `limit` ops outside."""
        return named_list([f"{op.name} (module {op.module_path or ''!r})" for op in self.outside], limit)

    def __str__(self) -> str:
        line = (f"XNNPACK: {self.partitions} partition{'s' * (self.partitions != 1)}, {self.delegated} ops "
                f"delegated, {len(self.outside)} on reference kernels")
        return line + (f": {self.describe_outside()}" if self.outside else "")


@dataclasses.dataclass(frozen=True)
class Latency:
    """Median ms per invoke of the export and of its float twin, timed in the
    same interleaved rounds on `threads` threads; `slower_rounds` of the
    `rounds` (pairs timed under the same load) had the export slower."""

    ms: float
    float_ms: float
    threads: int = 1
    rounds: int = 0
    slower_rounds: int = 0

    @property
    def vs_float(self) -> float:
        return self.ms / self.float_ms

    @property
    def maybe_slower(self) -> bool:
        """Slower than float by the medians, or in a third of the rounds or
        more: not reliably faster (a model of microseconds on two threads
        swings with its threads' hand-over)."""
        return self.vs_float > 1.0 or (self.rounds > 0 and 3 * self.slower_rounds >= self.rounds)

    def __str__(self) -> str:
        threads = f", {self.threads} threads" if self.threads != 1 else ""
        rounds = f", slower in {self.slower_rounds} of {self.rounds} rounds" if self.slower_rounds else ""
        return (f"latency{threads}: {self.ms:.3f} ms, float {self.float_ms:.3f} ms "
                f"({self.vs_float:.2f}x float{rounds})")


# An export is timed against its float twin by default when the model's
# float weights are at most this many bytes: there the twin converts in under
# a second and the timing takes under a second (2 thread counts x 11 rounds x
# 2 files x 20 ms), and there a quantized model can be slower than float with
# every op on XNNPACK (per-op fixed costs, and int8 kernels for convolutions
# of few input channels: the digits CNN's int8 file ran 1.2-1.5x float on one
# host and 0.55x on another). Larger models' speed is their matmuls', which
# the delegation check speaks for.
AUTO_BENCHMARK_BYTES = 32 << 20


def benchmark_threads() -> tuple[int, ...]:
    """The thread counts an export's benchmark times: 1, and 2 where the machine has two cores."""
    return (1, 2) if (os.cpu_count() or 1) >= 2 else (1,)


def timed_against_float(tflite: bytes, twin: bytes, inputs: Sequence[np.ndarray] = (), *, rounds: int = 11,
                        num_threads: int = 1) -> Latency:
    """`tflite` against its float `twin` in the same interleaved rounds (see
    `interleaved_latency`), with how many rounds each was the slower."""
    runners = _runners([tflite, twin], inputs, num_threads)
    quantized, float_ = interleaved_rounds([runner.invoke for runner in runners], rounds=rounds)
    return Latency(ms=float(np.median(quantized)), float_ms=float(np.median(float_)), threads=num_threads,
                   rounds=rounds, slower_rounds=sum(q > f for q, f in zip(quantized, float_)))


def slower_than_float(latencies: Sequence[Latency]) -> str | None:
    """The warning for the `latencies` where the export is (or may be) slower than float, or None."""
    slower = [latency for latency in latencies if latency.maybe_slower]
    if not slower:
        return None
    listing = "; ".join(f"{latency.threads} thread{'s' * (latency.threads != 1)}: {latency.ms:.3f} ms against "
                        f"{latency.float_ms:.3f} ms ({latency.vs_float:.2f}x, slower in {latency.slower_rounds} "
                        f"of {latency.rounds} rounds)" for latency in slower)
    verdict = ("runs slower than its float twin" if any(latency.vs_float > 1.0 for latency in slower)
               else "is not reliably faster than its float twin")
    return (f"The quantized model {verdict} on this machine ({listing}). "
            "Export.delegation lists the ops outside XNNPACK. Where XNNPACK runs every op, an int8 kernel "
            "can still lose to its float twin on a small model (measured: a 3x3 convolution over one input "
            "channel, 2.9x slower in int8 than in float on an Intel host with AMX): keep such a module in "
            "float with Rule(<module path>, skip=True) and export again to compare, or let "
            "odmlq.autotune(..., target=TuneTarget(max_latency_ratio=1.0, ...)) find the modules (it "
            "tries quantized groups in float when only the latency misses); benchmark=False skips this "
            "timing.")


def delegation(tflite: bytes, summary: ModelSummary) -> Delegation:
    """Which ops of `tflite` the default delegate takes (see the module docstring)."""
    runner = interpreter(tflite, num_threads=1)
    try:
        runner.invoke()  # tensors a kernel sizes at run time are allocated by then
    except (RuntimeError, ValueError):
        pass  # zeros a model cannot take (a gather's indices): allocation as planned
    nodes = runner._get_ops_details()
    delegate_outputs = {t for node in nodes if node["op_name"] == "DELEGATE" for t in node["outputs"]}

    def allocated(tensor: int) -> bool:
        try:
            runner.get_tensor(tensor)
        except ValueError:  # 'Tensor data is null': inside a partition
            return False
        return True

    by_index = {op.index: op for op in summary.ops}
    outside = []
    for node in nodes:
        op = by_index.get(node["index"])
        if node["op_name"] == "DELEGATE" or op is None:
            continue
        if any(allocated(t) and t not in delegate_outputs for t in node["outputs"] if t >= 0):
            outside.append(op)
    partitions = sum(node["op_name"] == "DELEGATE" for node in nodes)
    return Delegation(partitions=partitions, delegated=len(summary.ops) - len(outside), outside=tuple(outside))


def check_delegation(found: Delegation, schema: str, require_delegate: bool, stacklevel: int = 3,
                     timed: bool = False) -> None:
    """Refuses ops outside the delegate when `require_delegate`; otherwise warns
    when a quantized model's matmuls or convolutions run outside it (slower
    than float there, as a rule). `timed`: the export times itself against
    float next, so the warning does not ask for it."""
    if require_delegate and found.outside:
        raise DelegateError(
            f"require_delegate=True, but {len(found.outside)} ops run outside XNNPACK on LiteRT's reference "
            f"kernels ({found.partitions} partitions): {found.describe_outside()}. Quantize those ops with a "
            "schema XNNPACK runs (int8 static, or dynamic int8 for matmuls), keep them in float with "
            "Rule(<module>, skip=True), or drop require_delegate.")
    compute = found.compute_outside
    if schema != "float" and compute:
        listing = ", ".join(f"{op.name} (module {op.module_path or ''!r})" for op in compute[:4])
        more = f" and {len(compute) - 4} more" if len(compute) > 4 else ""
        warnings.warn(
            f"{len(compute)} quantized matmuls or convolutions run outside XNNPACK, on LiteRT's reference "
            f"kernels: {listing}{more}. This model may run slower than its float twin; "
            + ("the export times both next" if timed else "export with benchmark=True to measure both")
            + ", or with require_delegate=True to refuse such an export.",
            stacklevel=stacklevel)


def interleaved_latency(models: Sequence[bytes], inputs: Sequence[np.ndarray] = (), *, rounds: int = 7,
                        invokes: int | None = None, num_threads: int = 1) -> list[float]:
    """Median ms per invoke of each model, all timed in the same interleaved
    rounds after a warm-up (`odmlq.timing.interleaved_rounds`). `invokes` per
    model per round; default: for each model, as many as take it 20 ms (a
    model of microseconds is timed over thousands of invokes, not over its
    thread hand-overs' noise, and a fast model next to a slow one is not
    timed on one invoke after the slow one emptied the caches).
    `inputs` are set, in the input's dtype, where their shapes match the
    model's inputs and their kinds (float or integer) agree; other inputs
    stay zero."""
    runners = _runners(models, inputs, num_threads)
    return interleaved_ms([runner.invoke for runner in runners], rounds=rounds, repeats=invokes)


def _runners(models: Sequence[bytes], inputs: Sequence[np.ndarray], num_threads: int) -> list:
    """An interpreter per model with `inputs` set where they fit (see `interleaved_latency`)."""
    runners = [interpreter(m, num_threads=num_threads) for m in models]
    for runner in runners:
        for detail, x in zip(runner.get_input_details(), inputs):
            x = np.asarray(x)
            same_kind = (x.dtype.kind == "f") == (np.dtype(detail["dtype"]).kind == "f")
            if tuple(x.shape) == tuple(detail["shape"]) and same_kind:
                runner.set_tensor(detail["index"], x.astype(detail["dtype"]))
    return runners
