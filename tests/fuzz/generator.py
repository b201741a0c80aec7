"""Seeded random architectures: what odmlq must export right, or refuse by name.

`make_case(seed)` builds one small model from a seed: a Linen CNN (convolutions
with strides, dilation, groups and depthwise; BatchNorm with random statistics;
activations; residual adds; concatenations; max and average pools, padded
average pools that count their padding; bilinear and nearest resizes and
transposed convolutions; constants),
a Linen sequence model (dense, LayerNorm / RMSNorm, attention with and without
a causal mask, residual MLPs, 1-D convolutions and pools, a flipped branch
concatenated beside another reader of its input, a value computed twice,
transformer blocks stacked by nn.scan), a Linen MLP, or an NNX CNN with
BatchNorm and Dropout. The same seed gives the same model, weights and data.
`make_case(seed, family='nnx_seq')` builds an NNX sequence model instead
(nnx.Linear, nnx.Einsum, norms, nnx.MultiHeadAttention blocks with a gated
MLP, as Python layers or stacked by nnx.vmap and applied by nnx.scan, 1-D
nnx.Conv), a family the seeded draw does not pick.

`run_case(case)` exports it with the one-line int8 rule and no option, and
sorts the outcome (see `OUTCOMES`); `tests/fuzz/test_fuzz.py` runs a fast
subset, `bench/fuzz.py` the long run. `run_case(case, mixed=True)` keeps one
or two of its matmuls and convolutions, drawn from the seed, in float (a skip
rule) or in int16x8, before the one-line rule, as a user protecting a
sensitive layer writes: more precision must not make the outputs worse than
the one-line rule's (`worse_with_float`).
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.fuzz.models import ACTIVATIONS, FuzzCnn, FuzzMlp, FuzzNnxCnn, FuzzNnxSeq, FuzzSeq

# Drawn far more often than the others: what models mostly use.
_COMMON_ACTS = ("relu", "relu", "relu", "relu6", "gelu", "gelu", "tanh", "sigmoid", "hard_swish",
                "leaky_relu")

# How an export ended. Hard failures (a test fails on them): 'crash' (anything
# but an odmlq error escaped) and 'silently_wrong' (exported, then off by more
# than its kernels' tolerance on inputs calibration did not see).
# Mixed rules add 'worse_with_float': outputs vs float more than
# `WORSE_WITH_FLOAT_DB` under the one-line rule's on the same unseen inputs,
# with some ops in float or int16x8.
OUTCOMES = ("exported", "refused_before_conversion", "refused_after_conversion", "verification_error",
            "crash", "silently_wrong", "worse_with_float")
HARD_FAILURES = frozenset({"crash", "silently_wrong", "worse_with_float"})
# Keeping an op in float or int16 removes or refines its roundings and adds at
# most one at its output's readers: 3 dB is past what that moves on these models.
WORSE_WITH_FLOAT_DB = 3.0


@dataclasses.dataclass
class Case:
    seed: int
    family: str
    description: str
    model: Any
    variables: Any
    sample_shape: tuple[int, ...]
    input_scale: float

    def batches(self, n: int, batch: int, seed: int) -> list[tuple[np.ndarray]]:
        rng = np.random.default_rng(seed)
        return [((self.input_scale * rng.normal(size=(batch, *self.sample_shape))).astype(np.float32),)
                for _ in range(n)]


# ---------------------------------------------------------------------------
# Drawing architectures


def _act(rng, rare: float = 0.1) -> str:
    return str(rng.choice(list(ACTIVATIONS))) if rng.random() < rare else str(rng.choice(_COMMON_ACTS))


def _cnn_blocks(rng) -> tuple:
    blocks, channels, size = [], 3, 12
    for _ in range(int(rng.integers(2, 6))):
        r = rng.random()
        if r < 0.45:
            features = int(rng.choice([4, 8, 12, 16]))
            k = int(rng.choice([1, 3, 3, 5]))
            stride = 2 if size >= 6 and rng.random() < 0.3 else 1
            dilation = 2 if stride == 1 and k == 3 and rng.random() < 0.2 else 1
            groups = 1
            if channels > 3 and rng.random() < 0.3:
                groups = channels if rng.random() < 0.5 else int(np.gcd(channels, 4))
                features = channels * (1 if groups == channels else max(1, features // groups)) \
                    if groups == channels else groups * max(1, features // groups)
            blocks.append(("conv", features, k, stride, dilation, groups))
            channels, size = features, -(-size // stride)
            if rng.random() < 0.6:
                blocks.append(("bn",))
            blocks.append(("act", _act(rng)))
        elif r < 0.58 and channels > 3:
            blocks.append(("res",))
        elif r < 0.68:
            extra = int(rng.choice([2, 4, 8]))
            blocks.append(("concat", extra))
            channels += extra
        elif r < 0.82 and size >= 4:
            q = rng.random()
            if q < 0.4:
                padding = "SAME" if rng.random() < 0.4 else "VALID"
                blocks.append(("maxpool", 2, 2, padding))
                size //= 2
            elif q < 0.7:
                blocks.append(("avgpool", 2, 2))
                size //= 2
            else:  # Flax's default: SAME padding counted in the average
                blocks.append(("avgpool_same", 3))
        elif r < 0.88 and size <= 12:
            # Upsampling: an interpolating resize, or a transposed convolution
            # (stride 2, 'SAME': kernels smaller than, equal to and larger than the stride).
            if rng.random() < 0.8:
                blocks.append(("resize", str(rng.choice(["bilinear", "nearest"]))))
            else:
                features = int(rng.choice([4, 8]))
                blocks.append(("conv_transpose", features, int(rng.choice([2, 3, 4]))))
                channels = features
            size *= 2
        elif r < 0.9:
            blocks.append(("bn",))
        else:
            blocks.append(("scale", float(np.round(rng.uniform(0.3, 2.0), 2)),
                           float(np.round(rng.uniform(-1.0, 1.0), 2))))
    return tuple(blocks)


def _draw(rng, count: tuple[int, int], table) -> tuple:
    """`rng.integers(*count)` blocks, each from the first row of `table`
    (cumulative probability, ``make(rng) -> block``) above a uniform draw."""
    blocks = []
    for _ in range(int(rng.integers(*count))):
        r = rng.random()
        make = next((m for p, m in table if r < p), table[-1][1])
        blocks.append(make(rng))
    return tuple(blocks)


_SEQ_TABLE = (
    (0.25, lambda rng: ("attn", int(rng.choice([1, 2, 4])), bool(rng.random() < 0.5))),
    (0.42, lambda rng: ("mlp",)),
    (0.55, lambda rng: ("ln",) if rng.random() < 0.7 else ("rms",)),
    (0.66, lambda rng: ("dense",)),
    (0.77, lambda rng: ("act", _act(rng))),
    (0.82, lambda rng: ("softmax",)),
    (0.9, lambda rng: ("conv1d", int(rng.choice([1, 3, 5])), str(rng.choice(["none", "max", "avg"])))),
    (0.95, lambda rng: ("flip_concat",)),
    (0.98, lambda rng: ("twice", _act(rng))),
    (1.0, lambda rng: ("scan", int(rng.choice([2, 3])), int(rng.choice([1, 2])))),
)
_NNX_SEQ_TABLE = (
    (0.3, lambda rng: ("block", int(rng.choice([1, 2, 4])), bool(rng.random() < 0.5), bool(rng.random() < 0.3))),
    (0.45, lambda rng: ("scan", int(rng.choice([2, 3])), int(rng.choice([1, 2])), bool(rng.random() < 0.5))),
    (0.58, lambda rng: ("linear",)),
    (0.68, lambda rng: ("einsum",)),
    (0.8, lambda rng: ("ln",) if rng.random() < 0.6 else ("rms",)),
    (0.92, lambda rng: ("act", _act(rng))),
    (1.0, lambda rng: ("conv1d", int(rng.choice([1, 3])))),
)
_MLP_TABLE = (
    (0.4, lambda rng: ("dense", int(rng.choice([8, 16, 32])))),
    (0.7, lambda rng: ("act", _act(rng))),
    (0.85, lambda rng: ("res",)),
    (1.0, lambda rng: ("ln",)),
)


def _seq_blocks(rng) -> tuple:
    return _draw(rng, (2, 6), _SEQ_TABLE)


def _mlp_blocks(rng) -> tuple:
    return _draw(rng, (1, 5), _MLP_TABLE)


def _randomize_batch_stats(variables: Any, rng) -> Any:
    variables = jax.tree_util.tree_map(np.asarray, variables)
    if "batch_stats" not in variables:
        return variables

    def walk(stats, params):
        for key, value in stats.items():
            if isinstance(value, dict) and "mean" not in value:
                walk(value, params.get(key, {}) if params else {})
            elif isinstance(value, dict):
                n = value["mean"].shape[-1]
                value["mean"] = rng.normal(0, 0.5, n).astype(np.float32)
                value["var"] = rng.uniform(0.3, 2.0, n).astype(np.float32)
                p = params.get(key) if params else None
                if p is not None:
                    p["scale"] = rng.uniform(0.5, 1.5, n).astype(np.float32)
                    p["bias"] = rng.normal(0, 0.3, n).astype(np.float32)

    walk(variables["batch_stats"], variables.get("params", {}))
    return variables


def _family(rng) -> str:
    return str(rng.choice(["cnn", "cnn", "seq", "seq", "mlp", "nnx_cnn"]))


def case_family(seed: int) -> str:
    """The family `make_case(seed)` builds, without building it."""
    return _family(np.random.default_rng(seed))


def make_case(seed: int, family: str | None = None) -> Case:
    """The model of `seed`; `family` builds that family from the same seed
    instead of the drawn one ('nnx_seq' is built only so: the seeded draw of
    the other four stays as it was measured)."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    drawn = _family(rng)  # drawn either way: the rest of the seed's stream follows it
    family = family or drawn
    if family == "cnn":
        blocks = _cnn_blocks(rng)
        model, shape = FuzzCnn(blocks), (12, 12, 3)
        variables = _randomize_batch_stats(model.init(key, np.zeros((1, *shape), np.float32)), rng)
        description = " ".join(str(b) for b in blocks)
    elif family == "seq":
        blocks, width = _seq_blocks(rng), int(rng.choice([8, 16]))
        model, shape = FuzzSeq(blocks, width), (6, 8)
        variables = model.init(key, np.zeros((1, *shape), np.float32))
        description = f"width {width}: " + " ".join(str(b) for b in blocks)
    elif family == "mlp":
        blocks = _mlp_blocks(rng)
        model, shape = FuzzMlp(blocks), (10,)
        variables = model.init(key, np.zeros((1, *shape), np.float32))
        description = " ".join(str(b) for b in blocks)
    elif family == "nnx_seq":
        blocks, width = _draw(rng, (1, 4), _NNX_SEQ_TABLE), int(rng.choice([8, 16]))
        model, shape = FuzzNnxSeq(blocks, width, 8, rngs=nnx.Rngs(seed)), (6, 8)
        variables = None
        description = f"width {width}: " + " ".join(str(b) for b in blocks)
    elif family == "nnx_cnn":
        channels = tuple(int(c) for c in rng.choice([4, 8, 12], size=int(rng.integers(1, 4))))
        act = _act(rng)
        model = FuzzNnxCnn(channels, act, rngs=nnx.Rngs(seed))
        for norm in model.norms:
            n = norm.num_features
            norm.mean[...] = jnp.asarray(rng.normal(0, 0.5, n), jnp.float32)
            norm.var[...] = jnp.asarray(rng.uniform(0.3, 2.0, n), jnp.float32)
        variables, shape = None, (8, 8, 3)
        description = f"channels {channels}, {act}"
    else:
        raise ValueError(f"make_case: no family {family!r}")
    return Case(seed=seed, family=family, description=description, model=model, variables=variables,
                sample_shape=shape, input_scale=float(rng.choice([0.5, 1.0, 3.0])))


# ---------------------------------------------------------------------------
# Running one


@dataclasses.dataclass
class Outcome:
    seed: int
    family: str
    kind: str  # one of OUTCOMES
    detail: str = ""
    sqnr_db: float | None = None  # LiteRT outputs vs float on `SQNR_ROWS` fresh rows


def _unseen(case: Case) -> list[tuple[np.ndarray]]:
    """Inputs calibration did not see: a fresh batch, the same scaled up
    (ranges exceeded: clipping) and with noise added."""
    (fresh,) = case.batches(1, 4, case.seed + 10_000)
    x = fresh[0]
    rng = np.random.default_rng(case.seed + 20_000)
    return [(x,), ((1.5 * x).astype(np.float32),),
            ((x + 0.3 * case.input_scale * rng.normal(size=x.shape)).astype(np.float32),)]


def run_case(case: Case, mixed: bool = False) -> Outcome:
    import odmlq

    one_line = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    if not mixed:
        return _run(case, one_line)
    baseline = _run(case, one_line)
    if baseline.kind != "exported":
        return baseline
    rules, drawn = mixed_rules(case)
    outcome = _run(case, rules + one_line, allow_float_ops=True)
    outcome.detail = f"{drawn}; {outcome.detail}".rstrip("; ")
    if outcome.kind == "exported" and outcome.sqnr_db < baseline.sqnr_db - WORSE_WITH_FLOAT_DB:
        outcome.kind = "worse_with_float"
        outcome.detail = (f"{drawn}: {outcome.sqnr_db:.1f} dB vs float, against {baseline.sqnr_db:.1f} "
                          "with every op int8")
    return outcome


def mixed_rules(case: Case) -> tuple[list, str]:
    """One or two matmuls or convolutions of `case`, drawn from its seed, kept
    float (a skip rule) or in int16x8; and a line saying which."""
    import re

    import odmlq

    (x,) = case.batches(1, 1, case.seed)[0]
    graph = odmlq.trace(case.model, x, variables=case.variables)
    paths = sorted({op.module_path for op in graph.ops if op.kind in ("conv", "dot_general") and op.weights})
    rng = np.random.default_rng(case.seed + 30_000)
    picked = rng.choice(paths, size=min(len(paths), int(rng.integers(1, 3))), replace=False)
    rules, said = [], []
    for path in picked:
        skip = bool(rng.integers(2))
        rules.append(odmlq.Rule(re.escape(str(path)), skip=True) if skip
                     else odmlq.Rule(re.escape(str(path)), weight_qtype="int8", act_qtype="int16"))
        said.append(f"{path} {'float' if skip else 'int16x8'}")
    return rules, ", ".join(said)


def _run(case: Case, rules: list, allow_float_ops: bool = False) -> Outcome:
    import warnings

    import odmlq
    import odmlq.litert
    from odmlq.errors import OdmlqError

    try:
        with warnings.catch_warnings():
            if allow_float_ops:
                warnings.simplefilter("ignore")
            result = odmlq.export_tflite(case.model, rules, case.batches(8, 8, case.seed), variables=case.variables,
                                         allow_float_ops=allow_float_ops)
    except odmlq.VerificationError as e:
        return Outcome(case.seed, case.family, "verification_error", _first_line(e))
    except OdmlqError as e:
        frames = {f.name for f in traceback.extract_tb(e.__traceback__)}
        before = "check_plan" in frames or "convert" not in frames
        kind = "refused_before_conversion" if before else "refused_after_conversion"
        return Outcome(case.seed, case.family, kind, f"{type(e).__name__}: {_first_line(e)}")
    except Exception as e:  # anything else is a bug: it must be a named error
        return Outcome(case.seed, case.family, "crash", f"{type(e).__name__}: {_first_line(e)}")
    fresh, *perturbed = _unseen(case)
    sqnr = _litert_sqnr_db(case, result.tflite)
    for samples in ([fresh], perturbed):
        report = odmlq.litert.verify(result.tflite, case.model, result.plan, result.scales, samples,
                                     variables=case.variables, raise_on_failure=False)
        if not report.passed:
            bad = max((c for c in report.checks if not c.ok), key=lambda c: c.max_lsb, default=None)
            where = ("" if bad is None
                     else f"{bad.edge}: {bad.max_lsb:.3g} {bad.unit} (allowed {bad.allowed_lsb:.3g})")
            return Outcome(case.seed, case.family, "silently_wrong", where, sqnr)
    return Outcome(case.seed, case.family, "exported", "", sqnr)


# Fresh rows the outputs' SQNR against float is measured on. The 4 rows
# verification runs give a 4-class head 16 logits, on which one rounding moved
# an export by 2 dB (NNX sequence seed 21: LiteRT 31.9 dB where simulate gave
# 30.0), enough to call a mixed-rule export 3 dB worse than it is.
SQNR_ROWS = 64


def _litert_sqnr_db(case: Case, tflite: bytes) -> float:
    """The .tflite's outputs against the float model's on `SQNR_ROWS` fresh rows (dB)."""
    import odmlq.litert
    from odmlq.litert.verify import from_output, output_details, to_input

    (x,) = case.batches(1, SQNR_ROWS, case.seed + 40_000)[0]
    want = np.asarray(case.model(x) if case.variables is None else case.model.apply(case.variables, x), np.float64)
    interpreter = odmlq.litert.interpreter(tflite, num_threads=1)
    inp, out = interpreter.get_input_details()[0], output_details(interpreter)[0]
    batch, rows = int(inp["shape"][0]), []
    for start in range(0, SQNR_ROWS - batch + 1, batch):
        interpreter.set_tensor(inp["index"], to_input(x[start:start + batch], inp))
        interpreter.invoke()
        rows.append(from_output(interpreter.get_tensor(out["index"]), out))
    got = np.concatenate(rows).astype(np.float64)
    want = want[:len(got)]
    noise = float(np.sum((got - want) ** 2))
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(want ** 2) / noise))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""
