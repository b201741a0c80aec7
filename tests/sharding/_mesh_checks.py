"""Checks that need a mesh of 8 devices, run by test_mesh.py in a fresh process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
starts): ``python -m tests.sharding._mesh_checks NAME``."""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import odmlq
from odmlq.calibration._parallel import device_parts


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256, name="up")(x))
        return nn.Dense(64, name="down")(x)


MODEL = MLP()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 64)).astype(np.float32)
VARIABLES = MODEL.init(jax.random.key(0), X)


def _mesh(name: str, explicit: bool = False):
    types = (AxisType.Explicit if explicit else AxisType.Auto,)
    return jax.make_mesh((8,), (name,), axis_types=types)


def _tensor_parallel(mesh):
    """up column-parallel (split along its outputs), down row-parallel (along its inputs)."""
    def place(path, leaf):
        name = jax.tree_util.keystr(path)
        spec = P(None, "model") if "up" in name and "kernel" in name else (
            P("model", None) if "down" in name and "kernel" in name else P())
        return jax.device_put(leaf, NamedSharding(mesh, spec))
    return jax.tree_util.tree_map_with_path(place, VARIABLES)


SCHEMAS = {
    "int8 per channel": [odmlq.Rule(".*", weight_qtype="int8")],
    "int4 blocks of 32": [odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32))],
    "int4 per channel": [odmlq.Rule(".*", weight_qtype="int4")],
    "int8 asymmetric": [odmlq.Rule(".*", weight_qtype="int8", weight_symmetric=False,
                                   weight_calibration=odmlq.MinMax())],
    "int8 per tensor, percentile": [odmlq.Rule(".*", weight_qtype="int8", weight_granularity=odmlq.PerTensor(),
                                               weight_calibration=odmlq.Percentile(99.0))],
}
# Mesh axes of (up's scale, down's scale): along up's split outputs, replicated along down's
# split inputs, which its channels reduce (its blocks run along them: split too).
SCALES = {"int4 blocks of 32": ((None, "model"), ("model", None)),
          "int8 per tensor, percentile": ((None, None), (None, None))}


def _spec(x) -> tuple:
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def quantize_params() -> None:
    for explicit in (False, True):
        sharded = _tensor_parallel(_mesh("model", explicit))
        for name, rules in SCHEMAS.items():
            plan = odmlq.plan(MODEL, rules, X, variables=VARIABLES)
            one = jax.tree_util.tree_leaves_with_path(odmlq.quantize_params(VARIABLES, plan))
            eight = jax.tree_util.tree_leaves_with_path(odmlq.quantize_params(sharded, plan))
            for (path, a), (_, b) in zip(one, eight):
                where = f"{name}, {jax.tree_util.keystr(path)}"
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"{where}: differs from one device"
                if "kernel" in where and "qvalue" in where:
                    shards = {s.device.id: s.data.nbytes for s in b.addressable_shards}
                    assert len(shards) == 8 and set(shards.values()) == {b.nbytes // 8}, (where, shards)
            qup = odmlq.quantize_params(sharded, plan)["params"]["up"]["kernel"]
            qdown = odmlq.quantize_params(sharded, plan)["params"]["down"]["kernel"]
            up, down = SCALES.get(name, ((None, "model"), (None, None)))
            assert _spec(qup.scale) == up and _spec(qdown.scale) == down, (name, qup.scale.sharding,
                                                                           qdown.scale.sharding)
            if qup.zero_point is not None:
                assert _spec(qup.zero_point) == up
    print("quantize_params: bit for bit, 1/8 of the values per device")


def ptq() -> None:
    sharded = _tensor_parallel(_mesh("model"))
    for name, rules, tolerance in (
            ("int8 dynamic", [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)], 0.0),
            # A row-parallel float matmul sums its partial products in another order: float32 rounding.
            ("int8 weight-only", SCHEMAS["int8 per channel"], 1e-5),
            ("int4 blocks", SCHEMAS["int4 blocks of 32"], 1e-5)):
        one = odmlq.ptq(MODEL, rules, VARIABLES, example_inputs=(X,))
        eight = odmlq.ptq(MODEL, rules, sharded, example_inputs=(X,))
        kernel = eight.params["params"]["up"]["kernel"]
        assert len(kernel.qvalue.sharding.device_set) == 8, kernel.qvalue.sharding
        y1, y8 = np.asarray(one(X)), np.asarray(eight(X))
        error = np.abs(y1 - y8).max() / np.abs(y1).max()
        assert error <= tolerance, f"{name}: {error} relative"
    print("ptq: params stay sharded; outputs as on one device")


def calibrate() -> None:
    batches = [RNG.normal(size=(32, 64)).astype(np.float32) for _ in range(3)]
    mesh = _mesh("data")
    split = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in batches]
    replicated = jax.device_put(VARIABLES, NamedSharding(mesh, P()))
    assert len(device_parts((split[0],), replicated, {})) == 8
    assert len(device_parts((split[0],), VARIABLES, {})) == 8
    for method in (odmlq.MinMax(), odmlq.MinMax(headroom=True), odmlq.Percentile(99.9),
                   odmlq.MovingAverageMinMax()):
        rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_calibration=method)]
        plan = odmlq.plan(MODEL, rules, X, variables=VARIABLES)
        one = odmlq.calibrate(MODEL, plan, batches, variables=VARIABLES)
        for params in (VARIABLES, replicated):
            eight = odmlq.calibrate(MODEL, plan, split, variables=params)
            assert set(one) == set(eight)
            for edge in one:
                a, b = one[edge][1], eight[edge][1]
                for field in ("count", "min", "max", "batches", "histogram", "histogram_limit",
                              "moving_min", "moving_max", "top", "bottom"):
                    assert np.array_equal(getattr(a, field), getattr(b, field)), (method, edge, field)
                # float64 sums of the same float32 values in another order
                np.testing.assert_allclose(a.sum, b.sum, rtol=1e-12)
                np.testing.assert_allclose(a.sum_of_squares, b.sum_of_squares, rtol=1e-12)
            for param, gram in one.grams.items():
                # float32 partial sums per device (HIGHEST precision), added in float64
                np.testing.assert_allclose(eight.grams[param].matrix, gram.matrix, rtol=1e-5,
                                           atol=1e-6 * np.abs(gram.matrix).max())
                assert eight.grams[param].rows == gram.rows
    print("calibrate: data parallel over 8 devices, statistics as on one device")


def saved() -> None:
    """Params saved from the mesh load back onto it, each device reading its slice."""
    import tempfile

    sharded = _tensor_parallel(_mesh("model"))
    for name in ("int8 per channel", "int4 blocks of 32", "int8 asymmetric"):
        plan = odmlq.plan(MODEL, SCHEMAS[name], X, variables=VARIABLES)
        quantized = odmlq.quantize_params(sharded, plan)
        with tempfile.TemporaryDirectory() as directory:
            path = odmlq.save_params(f"{directory}/params.safetensors", quantized, plan)
            abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                              sharded)
            loaded = odmlq.load_params(path, plan, like=abstract)
            on_host = odmlq.load_params(path, plan, like=VARIABLES)
        for (path_, a), (_, b), (_, c) in zip(*(jax.tree_util.tree_leaves_with_path(t)
                                               for t in (quantized, loaded, on_host))):
            where = f"{name}, {jax.tree_util.keystr(path_)}"
            assert np.array_equal(np.asarray(a), np.asarray(b)) and np.array_equal(np.asarray(a), np.asarray(c)), where
            assert b.sharding == a.sharding, (where, b.sharding, a.sharding)
            assert not hasattr(c, "sharding") or len(c.sharding.device_set) == 1, where
        planned = odmlq.quantize_params(abstract, plan)  # abstract QArrays placed as the real ones are
        for (path_, a), (_, b) in zip(*(jax.tree_util.tree_leaves_with_path(t) for t in (quantized, planned))):
            assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding), jax.tree_util.keystr(path_)
    print("saved: loaded back onto the mesh as quantized there")


def refusals() -> None:
    sharded = _tensor_parallel(_mesh("model"))
    plan = odmlq.plan(MODEL, [odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(64))],
                      X, variables=VARIABLES)
    try:  # up's input axis (64) holds 8 rows per device: blocks of 64 cross devices
        odmlq.quantize_params(_row_split_up(), plan)
    except odmlq.CalibrationError as e:
        assert "cuts its blocks of 64" in str(e), e
    else:
        raise AssertionError("a shard cutting a block was not refused")
    plan = odmlq.plan(MODEL, [odmlq.Rule(".*", weight_qtype="int8", weight_algorithm=odmlq.GPTQ())],
                      X, variables=VARIABLES)
    calibration = odmlq.calibrate(MODEL, plan, [X], variables=VARIABLES)
    try:
        odmlq.quantize_params(sharded, plan, calibration=calibration)
    except odmlq.PlanError as e:
        assert "is sharded over devices" in str(e) and "Nearest()" in str(e), e
    else:
        raise AssertionError("GPTQ on sharded weights was not refused")
    print("refusals: blocks cut by shards, GPTQ on sharded weights")


def checkpoint() -> None:
    """The sample decoder streamed from a sharded checkpoint onto the mesh, tensor by tensor, as
    bench/sharded_decoder.py does at 1B parameters."""
    import tempfile

    from converters._checkpoint import nest
    from converters.sharded_checkpoint import ShardedCheckpoint, write_sharded
    from samples.decoder_model import Decoder, DecoderConfig
    from samples.decoder_tflite import decode_inputs

    model = Decoder(DecoderConfig(layers=2))
    variables = model.init(jax.random.key(1), np.zeros((1, 4), np.int32))
    named = {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
             for p, x in jax.tree_util.tree_leaves_with_path(variables["params"])}
    inputs = decode_inputs(model)
    rules = [odmlq.Rule("embedding.*", weight_qtype="int8"),
             odmlq.Rule(".*", op="dot_general", weight_qtype="int4", weight_granularity=odmlq.PerBlock(32))]
    plan = odmlq.plan(model, rules, *inputs, variables=variables, method="decode")
    mesh = _mesh("model")
    columns, rows = ("query", "key", "value", "gate", "up"), ("output", "down", "embedding")
    with tempfile.TemporaryDirectory() as directory:
        write_sharded(directory, iter(named.items()), max_file_bytes=2 ** 20)
        stored = ShardedCheckpoint(directory)
        assert len(set(stored.weight_map.values())) > 1
        params: dict = {}
        for name in stored:
            *module, leaf = name.split(".")
            spec = P(None, "model") if module[-1] in columns else P("model", None) if module[-1] in rows else P()
            value = stored.array(name, NamedSharding(mesh, spec))
            if "/".join(module + [leaf]) in plan.weight_specs():
                value = odmlq.quantize_params({leaf: value}, plan, prefix="/".join(module))[leaf]
            nest(params, tuple(module + [leaf]), value)
    whole = odmlq.quantize_params(variables, plan)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(whole),
                                 jax.tree_util.tree_leaves_with_path({"params": params})):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
        assert len(b.sharding.device_set) == 8
    sharded = odmlq.ptq(model, plan, {"params": params})
    one = odmlq.ptq(model, plan, whole)
    logits, keys, *_ = jax.jit(sharded.apply)(sharded.params, *inputs)
    expected, expected_keys, *_ = jax.jit(one.apply)(one.params, *inputs)
    # row-parallel matmuls add their partial sums in another order: float32 rounding
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=0,
                               atol=1e-5 * float(np.abs(expected).max()))
    np.testing.assert_allclose(np.asarray(keys), np.asarray(expected_keys), rtol=0,
                               atol=1e-5 * float(np.abs(expected_keys).max()))
    print("checkpoint: streamed onto the mesh, quantized bit for bit, decode step sharded")


def _row_split_up():
    mesh = _mesh("model")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.device_put(leaf, NamedSharding(
            mesh, P("model", None) if "up" in jax.tree_util.keystr(path) and leaf.ndim == 2 else P())),
        VARIABLES)


if __name__ == "__main__":
    assert jax.device_count() == 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    for check in sys.argv[1:]:
        globals()[check]()
