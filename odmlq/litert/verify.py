"""Verification: every op of an exported .tflite checked against `simulate`.

The model runs in the LiteRT interpreter with intermediate tensors kept.
Each quantized tensor is traced back to its plan edge (tensor names carry the
op ids; its scale and zero point must be the edge's). Then `simulate` runs
with every edge *fed LiteRT's own values*, so each op is computed from
exactly the inputs LiteRT's kernel saw, and its output is compared with
LiteRT's. Integer kernels may round a value a half step the other way, so
1 LSB of the edge's scale is allowed; a miscompile differs by many.

A model with no statically quantized edge (weight-only, dynamic-range) has
no LSB to count in: there every float tensor that carries a plan edge is
checked the same way, fed and compared, within `FLOAT_TOLERANCE` of the
largest value of the op's output or inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from odmlq.batches import leaves, model_inputs, row_count, sliced, taken_whole
from odmlq.graph import GraphCache, params_for
from odmlq.litert._mapping import (float_island_outputs, as_edge, dequantize_tensor, map_conversions, map_steps,
                                   map_float_tensors, map_tensors, params_match, produced_tensors)
from odmlq.litert._probe import LiteRTCrashError, probe
from odmlq.litert._runtime import interpreter
from odmlq.litert._differences import magnitude, relative_difference
from odmlq.litert._tolerance import allowed_lsb
from odmlq.plan import dynamic_kernel_inputs, named_list, text_table as table
from odmlq.progress import steps
from odmlq.errors import OdmlqError

__all__ = ["EdgeCheck", "LiteRTCrashError", "VerificationError", "VerificationReport", "dequantize_tensor", "from_output",
           "map_conversions", "map_tensors", "params_match", "preserving_interpreter", "produced_tensors", "sample_rows",
           "to_input", "verify"]

# Rounding in an integer kernel may differ from round-half-even in float by one
# step; float32 noise in the comparison adds a little on top: float32 holds 24
# bits, an int16 value up to 15 of them, so ~2^-9 LSB per rounding there.
_SLACK_LSB = {"int8": 1e-3, "int16": 1e-2}

# A float op of a weight-only or dynamic-range model against simulate fed the
# same inputs, relative to the largest value of its output or of its inputs
# (a LayerNorm's mean is far smaller than the values it sums, and rounds at
# their size: BERT's, 1.5e-4 of its own largest value). Measured: exact
# for elementwise ops and int8 dynamic matmuls; XNNPACK's own MEAN, RSQRT,
# SOFTMAX, LOGISTIC and GELU and its int4 block sums up to 1.1e-6 (the sample
# decoder, MiniLM, the digits CNN). A miscompile (a wrong layout, scale or
# weight) is off by a good part of the value.
FLOAT_TOLERANCE = 1e-4


class VerificationError(OdmlqError, AssertionError):
    """The exported model disagrees with the simulation by more than allowed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EdgeCheck:
    edge: str
    op: str | None
    module_path: str
    tensor: int
    max_lsb: float
    mean_lsb: float
    params_match: bool
    # Allowed max_lsb: the verification's tolerance, or the kernel's own where
    # LiteRT approximates (see `odmlq.litert.spec.OpSpec.tolerance_lsb`), plus
    # float32 noise at this qtype.
    allowed_lsb: float = 1.0 + 1e-3
    # "LSB" of the edge's scale, or "of max": a float edge's difference relative
    # to the largest value of its op's output or inputs (`FLOAT_TOLERANCE`).
    unit: str = "LSB"

    @property
    def ok(self) -> bool:
        return self.params_match and self.max_lsb <= self.allowed_lsb


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerificationReport:
    """Per-edge differences (LiteRT vs simulate fed LiteRT's inputs) and end to end."""

    checks: tuple[EdgeCheck, ...]
    min_output_sqnr_db: float | None = None
    unmapped_edges: tuple[str, ...]
    unmapped_tensors: tuple[str, ...]
    output_max_lsb: float
    output_sqnr_db: float
    samples: int
    tolerance_lsb: float
    # Outputs against float: LiteRT's and simulate's (None when not measured).
    litert_float_sqnr_db: float | None = None
    simulate_float_sqnr_db: float | None = None
    # Modules whose dynamic inputs are symmetric: verified on LiteRT's built-in
    # kernels, which quantize them so; XNNPACK quantizes them asymmetrically.
    builtin_kernels_for: tuple[str, ...] = ()

    @property
    def end_to_end_ok(self) -> bool:
        """Outputs >= `min_output_sqnr_db` against simulate, or, for a deep
        model where one-LSB rounding differences grow layer by layer, as close
        to float as simulate is (within `FLOAT_SQNR_SLACK_DB`)."""
        if self.min_output_sqnr_db is None or self.output_sqnr_db >= self.min_output_sqnr_db:
            return True
        if self.litert_float_sqnr_db is None or self.simulate_float_sqnr_db is None:
            return False
        return self.litert_float_sqnr_db >= self.simulate_float_sqnr_db - FLOAT_SQNR_SLACK_DB

    @property
    def worst(self) -> EdgeCheck | None:
        return max(self.checks, key=lambda c: c.max_lsb, default=None)

    @property
    def passed(self) -> bool:
        if not self.end_to_end_ok:
            return False
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        rows = [[c.edge, c.module_path or "''", str(c.tensor), _cell(c.max_lsb, c.unit, 3),
                 _cell(c.mean_lsb, c.unit, 4), "yes" if c.params_match else "NO"] for c in self.checks]
        within = f"{self.tolerance_lsb:g} LSB"
        wider = [c.allowed_lsb for c in self.checks if c.unit == "LSB" and c.allowed_lsb > self.tolerance_lsb + 0.5]
        if wider:  # an approximating kernel's own tolerance, or steps of a loop (`_tolerance`)
            within += f" ({len(wider)} edge(s) up to {max(wider):.0f} LSB: kernels' or loops' own tolerance)"
        if self.checks and all(c.unit != "LSB" for c in self.checks):
            within = f"{FLOAT_TOLERANCE:g} (of the largest value of each op's output or inputs)"
        lines = [f"Verification on {self.samples} samples: every op within "
                 f"{within} of simulate: {'yes' if self.passed else 'NO'}"
                 + (f" (outputs >= {self.min_output_sqnr_db:g} dB)" if self.min_output_sqnr_db else ""),
                 table(["edge", "module", "tensor", "max diff", "mean diff", "scale ok"], rows)
                 + ("\n(diff: in LSB of the edge's scale; as 1.2e-07, relative to the largest value of the "
                    "op's output or inputs)"
                    if any(c.unit != "LSB" for c in self.checks) else ""),
                 f"end to end vs simulate: max {self.output_max_lsb:.3f} LSB, "
                 f"SQNR {self.output_sqnr_db:.1f} dB"]
        if self.litert_float_sqnr_db is not None and self.simulate_float_sqnr_db is not None:
            lines.append(f"outputs vs float: LiteRT {self.litert_float_sqnr_db:.1f} dB, "
                         f"simulate {self.simulate_float_sqnr_db:.1f} dB")
        if self.builtin_kernels_for:
            lines.append(_BUILTIN_NOTE.format(modules=", ".join(self.builtin_kernels_for)))
        if self.unmapped_edges:
            lines.append("edges with no tensor in the model: "
                         + named_list(self.unmapped_edges, where="VerificationReport.unmapped_edges"))
        if self.unmapped_tensors:
            lines.append("tensors with no plan edge: "
                         + named_list(self.unmapped_tensors, where="VerificationReport.unmapped_tensors"))
        return "\n".join(lines)


def preserving_interpreter(tflite: bytes, what: str = "the model", default_delegate: bool = True):
    """A LiteRT interpreter for `tflite` that keeps every intermediate tensor, allocated.

    The model is first loaded and invoked in a child process (`_probe`): a
    model that crashes LiteRT raises `LiteRTCrashError` instead of ending
    this process. `default_delegate`: False runs the built-in kernels alone.
    """
    probe(tflite, what)
    return interpreter(tflite, preserve_all_tensors=True, default_delegate=default_delegate)


_BUILTIN_NOTE = (
    "verified on LiteRT's built-in kernels: the plan quantizes the dynamic inputs of {modules} "
    "symmetrically, as the built-in hybrid kernels do, where XNNPACK (LiteRT's default delegate) "
    "quantizes them asymmetrically; run the file without the default delegate to compute what the plan "
    "says, or quantize those inputs asymmetrically (act_symmetric=False) to run them on XNNPACK as verified")


def symmetric_dynamic_modules(plan) -> tuple[str, ...]:
    """Modules of the matmuls whose inputs the plan quantizes at run time on a
    symmetric integer grid (XNNPACK's dynamic-range kernels take asymmetric ones)."""
    from odmlq.qtypes import qtype as lookup_qtype

    found = [plan.graph.op(op_id).module_path for op_id, inputs in dynamic_kernel_inputs(plan).items()
             if any(spec.symmetric and lookup_qtype(spec.qtype).is_integer for _, spec in inputs)]
    return tuple(dict.fromkeys(found))


def verify(tflite: bytes, model: Any, plan, scales, samples: Sequence[Any], *, variables: Any = None,
           tolerance_lsb: float = 1.0, min_output_sqnr_db: float | None = None,
           raise_on_failure: bool = True, progress: bool | None = False,
           float_samples: int | None = None) -> VerificationReport:
    """Checks an exported model op by op against `simulate`.

    Args:
      tflite: the flatbuffer.
      model, plan, scales, variables: what it was exported from.
      samples: input batches (arrays, or tuples for several inputs), split
        into the model's batch size.
      tolerance_lsb: allowed difference per element, in LSBs of each edge.
      min_output_sqnr_db: for models whose activations are float (weight-only,
        dynamic-range), the least SQNR of LiteRT's outputs against simulate's.
      progress: a bar over the rows checked on stderr (None: when stderr is
        a terminal).
      float_samples: how many of the first samples the outputs are also
        compared with the float model on (`VerificationReport.litert_float_sqnr_db`);
        None: all. The export's perturbed copies (`verification_samples`) lie
        outside the calibrated ranges by design: checked against simulate only.

    Raises:
      VerificationError: naming the op, its module path and the difference,
        when an op differs by more than `tolerance_lsb` or a tensor's scale is
        not its edge's.
    """
    from odmlq.simulate import Simulator

    builtin = symmetric_dynamic_modules(plan)
    if builtin:
        warnings.warn(_BUILTIN_NOTE.format(modules=", ".join(builtin)) + ".", UserWarning, stacklevel=2)
    try:
        interpreter = preserving_interpreter(tflite, default_delegate=not builtin)
    except (RuntimeError, ValueError) as e:
        raise VerificationError(
            f"The LiteRT interpreter cannot run the converted model: {e}. The converter "
            "produced a kernel configuration LiteRT rejects; quantize the op it names "
            "differently or keep it in float."
        ) from e
    details = interpreter.get_tensor_details()
    written = produced_tensors(interpreter)  # in execution order
    produced = set(written)
    # Conversions are checked and fed like edges: LiteRT's requantization
    # rounds a near-tie its own way (twice), and one LSB of a coarse int8
    # input is several of its reader's output.
    ops = interpreter._get_ops_details()
    conversions = map_conversions(ops, details, plan, scales)
    mapping = map_tensors(details, produced, plan, scales, conversions=frozenset(conversions.values()), ops=ops)
    island_outputs = float_island_outputs(ops, details, plan)
    # No quantized edge: every float tensor of an edge is fed and checked.
    float_mapping = {} if scales.edges else map_float_tensors(
        details, written, plan, scales, ops, [d["index"] for d in interpreter.get_input_details()],
        [d["index"] for d in output_details(interpreter)])
    float_stats: dict[str, list] = {e: [0.0, 0.0, 0] for e in float_mapping}
    # An edge inside a loop: a tensor per step, checked and fed step by step.
    step_mapping = {e: {k: i for k, i in enumerate(t) if i is not None}
                    for e, t in map_steps(details, produced, plan, scales, ops).items() if e not in mapping}
    targets, where = _checked_tensors(plan, scales, [*mapping, *step_mapping], conversions)
    mapping = {**mapping, **conversions}
    by_index = {d["index"]: d for d in details}
    simulator = Simulator(model, plan, scales, variables=variables)
    stats: dict[str, list] = {e: [0.0, 0.0, 0] for e in [*mapping, *step_mapping]}
    out_err, out_sig, out_noise, n = 0.0, 0.0, 0.0, 0
    float_sig = float_noise_litert = float_noise_sim = 0.0
    graphs = GraphCache(model, plan, variables)
    params = params_for(model, variables, "verify")
    # Rows of the first `float_samples` samples (held-back data) are also compared with float.
    limit = len(samples) if float_samples is None else float_samples
    rows = [(k < limit, row) for k, sample in enumerate(samples) for row in sample_rows([sample], interpreter)]
    for against_float, inputs in steps(rows, "verifying", progress=progress, unit="row"):
        for d, x in zip(interpreter.get_input_details(), leaves(inputs)):
            interpreter.set_tensor(d["index"], to_input(x, d))
        interpreter.invoke()
        litert = {e: dequantize_tensor(interpreter.get_tensor(i), by_index[i]) for e, i in mapping.items()}
        # Float ops' outputs that integer ops read through a QUANTIZE are fed
        # too: LiteRT's float kernels and XLA differ by float32 noise, which a
        # fine int16 grid would turn into an LSB downstream.
        floats = {e: np.asarray(interpreter.get_tensor(i)) for e, i in {**island_outputs, **float_mapping}.items()}
        shapes = {**{e: plan.graph.edges[e].shape for e in floats}, **{e: t[1] for e, t in targets.items()}}
        feed = {e: as_edge(x, shapes[e]) for e, x in {**floats, **litert}.items()}
        for e, indices in step_mapping.items():  # {step: value} of the steps with a tensor
            values = {k: dequantize_tensor(interpreter.get_tensor(i), by_index[i]) for k, i in indices.items()}
            litert[e] = np.stack(list(values.values()))
            laid_out = {k: as_edge(x, shapes[e]) for k, x in values.items()}
            feed[e] = {k: x for k, x in laid_out.items() if x is not None} or None
        run = functools.partial(simulator, *inputs, capture=True, capture_conversions=bool(conversions),
                                feed={e: x for e, x in feed.items() if x is not None})
        _, fed = run()
        for e in [*mapping, *step_mapping]:
            want = np.asarray(fed[e])[list(step_mapping[e])] if e in step_mapping else np.asarray(fed[e])
            if litert[e].size != want.size:
                raise VerificationError(
                    f"Exported op {where[e][0]!r} (module {where[e][1]!r}, "
                    f"edge {e!r}) computes a tensor of shape {litert[e].shape} where the model's is "
                    f"{want.shape}: litert-converter lowered it to other semantics. Keep it in float "
                    "with Rule(..., skip=True) and check the float export, or write the op another way.")
            lsb = np.abs(want - litert[e].reshape(want.shape)) / np.asarray(targets[e][0].scale)
            s = stats[e]
            s[0], s[1], s[2] = max(s[0], float(lsb.max())), s[1] + float(lsb.sum()), s[2] + lsb.size
        for e in float_mapping:
            want = np.asarray(fed[e], np.float64)
            got = floats[e].astype(np.float64)
            if got.size != want.size:
                continue  # as_edge left it unfed: the converter reshaped it to another size
            relative = relative_difference(want, got.reshape(want.shape), magnitude(plan, e, want, fed))
            s = float_stats[e]
            s[0], s[1], s[2] = max(s[0], float(relative.max())), s[1] + float(relative.sum()), s[2] + relative.size
        expected = np.concatenate([np.asarray(o, np.float32).reshape(-1)
                                   for o in jax.tree_util.tree_leaves(run(use_feed=False)[0])])
        got = np.concatenate([from_output(interpreter.get_tensor(d["index"]), d).reshape(-1)
                              for d in output_details(interpreter)])
        if got.size != expected.size:
            shapes = [tuple(int(n) for n in d["shape"]) for d in output_details(interpreter)]
            raise VerificationError(
                f"The exported model's outputs have shapes {shapes} ({got.size} values) where the model's "
                f"have {expected.size} values: litert-converter lowered an op to other semantics. Export "
                "with the ops kept in float one by one (Rule(..., skip=True)) to find it.")
        out_scale = _output_scale(plan, scales)
        out_err = max(out_err, float(np.max(np.abs(got - expected)) / out_scale))
        out_sig += float(np.sum(expected.astype(np.float64) ** 2))
        out_noise += float(np.sum((got - expected).astype(np.float64) ** 2))
        if against_float:
            reference = np.concatenate([np.asarray(o, np.float64).reshape(-1) for o in jax.tree_util.tree_leaves(
                graphs.float_run(params, tuple(inputs)))])
            float_sig += float(np.sum(reference ** 2))
            float_noise_litert += float(np.sum((got - reference) ** 2))
            float_noise_sim += float(np.sum((expected - reference) ** 2))
        n += 1
    fed = frozenset(mapping) | frozenset(step_mapping) | frozenset(island_outputs) | frozenset(float_mapping)
    mapping.update({e: list(indices.values())[-1] for e, indices in step_mapping.items()})  # a check names the last
    checks = tuple(
        EdgeCheck(edge=e, op=where[e][0], module_path=where[e][1], tensor=i, max_lsb=stats[e][0],
                  mean_lsb=stats[e][1] / max(stats[e][2], 1),
                  params_match=all(params_match(by_index[t], targets[e][0]) for t in step_mapping.get(e, {0: i}).values()),
                  allowed_lsb=(allowed_lsb(plan, scales, e, tolerance_lsb, _SLACK_LSB.get(str(scales.edges[e].qtype), 1e-3),
                                           fed) if e in scales.edges
                               else tolerance_lsb + _SLACK_LSB.get(str(targets[e][0].qtype), 1e-3)))
        for e, i in mapping.items()) + tuple(
        EdgeCheck(edge=e, op=plan.graph.edges[e].producer, module_path=_module_path(plan, e), tensor=i,
                  max_lsb=float_stats[e][0], mean_lsb=float_stats[e][1] / max(float_stats[e][2], 1),
                  params_match=True, allowed_lsb=FLOAT_TOLERANCE, unit="of max")
        for e, i in float_mapping.items() if float_stats[e][2])
    quantized = [e for e in scales.edges if plan.graph.edges[e].alias is None]
    report = VerificationReport(
        checks=checks,
        unmapped_edges=tuple(e for e in quantized if e not in mapping),
        unmapped_tensors=tuple(by_index[i]["name"] for i in sorted(produced)
                               if i not in mapping.values()
                               and by_index[i]["dtype"] in (np.int8, np.int16)),
        output_max_lsb=out_err,
        output_sqnr_db=float(10 * np.log10(out_sig / out_noise)) if out_noise > 0 else float("inf"),
        samples=n, tolerance_lsb=tolerance_lsb, min_output_sqnr_db=min_output_sqnr_db,
        litert_float_sqnr_db=_db(float_sig, float_noise_litert),
        simulate_float_sqnr_db=_db(float_sig, float_noise_sim), builtin_kernels_for=builtin)
    if raise_on_failure and not all(c.ok for c in checks):
        bad = [c for c in checks if not c.ok]
        worst = max(bad, key=lambda c: (not c.params_match, c.max_lsb))
        what = ("its scale/zero point in the .tflite are not the plan's" if not worst.params_match
                else f"differs from simulate by up to {_amount(worst.max_lsb, worst.unit, 2)} "
                     f"(allowed {_amount(worst.allowed_lsb, worst.unit, 3)})")
        raise VerificationError(
            f"Exported op {worst.op!r} (module {worst.module_path!r}, edge {worst.edge!r}) {what}: "
            f"the converter produced a kernel that does not compute what the plan says. "
            f"{len(bad)} edge(s) fail.\n{report}"
        )
    if raise_on_failure and not report.end_to_end_ok:
        against_float = ("" if report.litert_float_sqnr_db is None or report.simulate_float_sqnr_db is None
                         else f", and {report.litert_float_sqnr_db:.1f} dB against float where simulate "
                              f"reaches {report.simulate_float_sqnr_db:.1f} dB (at most "
                              f"{FLOAT_SQNR_SLACK_DB:g} dB less allowed)")
        raise VerificationError(
            f"The exported model's outputs reach only {report.output_sqnr_db:.1f} dB SQNR against "
            f"simulate (at least {min_output_sqnr_db:g} dB expected){against_float}. Every op is "
            "within its tolerance of simulate: LiteRT's kernels round a half step their own way, "
            "and this model magnifies those one-LSB differences. Find the edges that lose the most "
            "with odmlq.compare(...) and give them int16 activations or keep them in float with a "
            "skip rule; verify=False writes the file as it is.\n"
            f"{report}"
        )
    return report


def _checked_tensors(plan, scales, edges, conversions) -> tuple[dict, dict]:
    """For each checked edge and conversion (by name): its (TensorScale,
    shape), and the (op, module path) an error names: the edge's producer, or
    the first op reading the conversion (LiteRT's QUANTIZE is in its scope)."""
    conversion_of = {c.name: c for c in plan.conversions.values()}
    targets = {e: (scales.edges[e], plan.graph.edges[e].shape) for e in edges}
    where = {e: (plan.graph.edges[e].producer, _module_path(plan, e)) for e in edges}
    for name in conversions:
        c = conversion_of[name]
        targets[name] = (scales.conversions[c.key], plan.graph.edges[c.edge].shape)
        where[name] = (c.consumers[0], plan.graph.op(c.consumers[0]).module_path)
    return targets, where


def _cell(value: float, unit: str, digits: int) -> str:
    return f"{value:.{digits}f}" if unit == "LSB" else f"{value:.1e}"


def _amount(value: float, unit: str, digits: int) -> str:
    """An EdgeCheck's difference: LSBs as a number, a float edge's as a fraction of the largest
    value of its op's output or inputs."""
    return f"{value:.{digits}f} LSB" if unit == "LSB" else f"{value:.2g} of the largest value of its output or inputs"


def _module_path(plan, edge_id: str) -> str:
    producer = plan.graph.edges[edge_id].producer
    return plan.graph.op(producer).module_path if producer else ""


# One-LSB rounding differences between LiteRT's kernels and simulate grow
# through a deep model (a 6-layer BERT encoder: every op within 1 LSB, outputs
# 19.8 dB apart, yet both as close to float: mean cosine 0.9929 and 0.9930 on
# 163 sentences); the export must then be as accurate as simulate promised.
FLOAT_SQNR_SLACK_DB = 1.0


def _db(signal: float, noise: float) -> float:
    return float("inf") if noise == 0 else float(10 * np.log10(signal / noise))


def _output_scale(plan, scales) -> float:
    outs = [e for e in plan.graph.outputs if e in scales.edges]
    if not outs:
        return 1.0
    return float(np.min(np.asarray(scales.edges[outs[0]].scale)))


def output_details(interpreter) -> list[dict]:
    """The output tensors' details in the model's output order (its outputs'
    leaves, named ``output_<i>`` by the export), which the interpreter's own
    list need not follow (seen: a dict of two outputs listed in reverse)."""
    details = interpreter.get_output_details()
    try:
        named = interpreter.get_signature_runner().get_output_details()
    except (ValueError, RuntimeError):  # no signature: the interpreter's order
        return details
    order = {d["index"]: int(name.rpartition("_")[2]) for name, d in named.items()
             if re.fullmatch(r".*output_\d+", name)}
    if len(order) != len(details):
        return details
    return sorted(details, key=lambda d: order[d["index"]])


def sample_rows(samples, interpreter):
    batch = int(interpreter.get_input_details()[0]["shape"][0])
    for sample in samples:
        inputs = model_inputs(sample)
        if taken_whole(inputs):  # a graph: one example at the exported shapes
            yield sliced(inputs, 0, None)
            continue
        for start in range(0, row_count(inputs) - batch + 1, batch):
            yield sliced(inputs, start, start + batch)


def to_input(x: np.ndarray, detail: dict) -> np.ndarray:
    if detail["dtype"] in (np.int8, np.int16):
        scale, zp = detail["quantization"]
        info = np.iinfo(detail["dtype"])
        return np.clip(np.round(x / scale) + zp, info.min, info.max).astype(detail["dtype"])
    return x.astype(detail["dtype"])


def from_output(y: np.ndarray, detail: dict) -> np.ndarray:
    if detail["dtype"] in (np.int8, np.int16):
        scale, zp = detail["quantization"]
        return (y.astype(np.float32) - zp) * scale
    return y.astype(np.float32)
