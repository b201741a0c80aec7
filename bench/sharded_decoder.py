"""A 1B-parameter decoder quantized on a mesh of 8 devices, streamed from a sharded checkpoint.

The decoder of `samples.decoder_model` at TinyLlama's sizes (hidden 2048, 22
layers, 32 query and 4 key/value heads of 64, gated MLP of 5632, a 32000-token
tied embedding: 1.03B parameters), random weights:

1. ``write``: a bfloat16 checkpoint in Hugging Face's sharded safetensors
   layout (`converters.sharded_checkpoint`), generated tensor by tensor: the
   float model is never in memory.
2. ``quantize`` (a fresh process, so its peak memory is its own): on a
   simulated mesh of 8 CPU devices (``--xla_force_host_platform_device_count``),
   the plan is traced from abstract shapes; then, tensor by tensor (largest
   first, so the peak comes with the smallest tensors on top), each
   device reads its own slice of the checkpoint (Megatron layout: query, key,
   value, gate and up split along their outputs; output and down along their
   inputs; the embedding along its rows), `odmlq.quantize_params` quantizes
   it where it lies, and the float tensor is dropped. Peak host RSS
   (``ru_maxrss``) is measured against the quantized params' bytes. Then the
   jitted decode step (`odmlq.ptq` of the decode method) runs on the sharded
   params, and its logits are checked against the same params on one device.

On this simulated mesh every device is host memory, so the host RSS is the
memory of all devices together: what it shows is that no second copy of the
weights, and no float model, is ever made.

Run: ``python bench/sharded_decoder.py [--checkpoint DIR] [--schema int8|int4]`` (about 5 minutes;
the checkpoint takes 2.1 GB of disk and is reused).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICES = 8
CONFIG = dict(vocab_size=32000, hidden=2048, layers=22, heads=32, kv_heads=4, head_dim=64, mlp_hidden=5632,
              cache_length=256)
COLUMNS = ("query", "key", "value", "gate", "up")  # split along their outputs
ROWS = ("output", "down", "embedding")  # split along their inputs (the embedding: its rows)


def _model():
    from samples.decoder_model import Decoder, DecoderConfig

    return Decoder(DecoderConfig(**CONFIG))


def _shapes(model) -> dict[str, tuple]:
    import jax
    import numpy as np

    abstract = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 1), np.int32))
    return {".".join(str(k.key) for k in path): leaf.shape
            for path, leaf in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]}


def write(directory: str) -> None:
    """The checkpoint, one tensor in memory at a time (bfloat16, scaled as the model initializes)."""
    import ml_dtypes
    import numpy as np

    from converters.sharded_checkpoint import write_sharded

    model = _model()
    shapes = _shapes(model)

    def tensors():
        for i, (name, shape) in enumerate(shapes.items()):
            rng = np.random.default_rng(i)
            if name.endswith("scale"):
                values = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
            else:
                values = rng.standard_normal(shape, np.float32) * np.float32(shape[-1 if "embedding" in name else 0]
                                                                             ** -0.5)
            yield name, values.astype(ml_dtypes.bfloat16)

    start = time.perf_counter()
    files = write_sharded(directory, tensors(), max_file_bytes=2 ** 30,
                          metadata={"decoder_config": json.dumps(CONFIG)})
    print(f"wrote {len(files)} files in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def _spec(name: str):
    from jax.sharding import PartitionSpec as P

    module = name.split(".")[-2]
    if module in COLUMNS:
        return P(None, "model")
    if module in ROWS:
        return P("model", None)
    return P()


def trim() -> None:
    """Hands the memory freed since the last call back to the system. glibc keeps
    freed blocks in the arena of the thread that freed them (XLA's device threads
    have one each), where the next tensor's buffers, made on other threads, do not
    reuse them: without this the first (largest) tensor's temporaries stay resident."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def quantize(directory: str, schema: str) -> dict:
    """Runs in a process of its own with 8 devices (see `main`)."""
    import resource

    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import odmlq
    from converters._checkpoint import nest
    from converters.sharded_checkpoint import ShardedCheckpoint
    from samples.decoder_tflite import decode_inputs

    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    model = _model()
    nearest = odmlq.Nearest()
    rules = {"int8": [odmlq.Rule("embedding.*", weight_qtype="int8", weight_algorithm=nearest),
                      odmlq.Rule(".*", op="dot_general", weight_qtype="int8", weight_algorithm=nearest)],
             "int4": [odmlq.Rule("embedding.*", weight_qtype="int8", weight_algorithm=nearest),
                      odmlq.Rule(".*", op="dot_general", weight_qtype="int4",
                                 weight_granularity=odmlq.PerBlock(32), weight_algorithm=nearest)]}[schema]
    abstract = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 1), np.int32))
    inputs = decode_inputs(model)
    plan = odmlq.plan(model, rules, *inputs, variables=abstract, method="decode")
    checkpoint = ShardedCheckpoint(directory)
    jax.clear_caches()  # tracing's caches: the plan holds what it needs
    del abstract
    trim()
    before = _rss_mib()
    start = time.perf_counter()
    params: dict = {}
    largest = 0
    # Largest first: the float tensor and its temporaries are largest while the
    # quantized params already held are fewest.
    for name in sorted(checkpoint, key=lambda n: -int(np.prod(checkpoint.shape(n)))):
        *module, leaf = name.split(".")
        value = checkpoint.array(name, NamedSharding(mesh, _spec(name)))
        largest = max(largest, value.nbytes)
        if "/".join(module + [leaf]) in plan.weight_specs():
            value = odmlq.quantize_params({leaf: value}, plan, prefix="/".join(module))[leaf]
        else:  # the norms' scales stay float, as traced
            value = value.astype(np.float32)
        # Done before the next read: otherwise XLA's queue holds several float tensors at once.
        nest(params, tuple(module + [leaf]), jax.block_until_ready(value))
        del value
        trim()
    quantize_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    after = _rss_mib()
    stored = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    parameters = sum(int(np.prod(checkpoint.shape(n))) for n in checkpoint)
    kernel = params["layer_0"]["up"]["kernel"]
    shard_bytes = sorted({s.data.nbytes for s in kernel.qvalue.addressable_shards})

    qmodel = odmlq.ptq(model, plan, {"params": params})
    step = jax.jit(qmodel.apply)
    replicated = NamedSharding(mesh, P())
    placed = tuple(jax.device_put(x, replicated) for x in inputs)
    logits, *cache = jax.block_until_ready(step(qmodel.params, *placed))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(step(qmodel.params, *placed))
        times.append(time.perf_counter() - t)
    on_one = jax.device_put(qmodel.params, jax.devices()[0])
    reference = np.asarray(jax.jit(qmodel.apply)(on_one, *inputs)[0])
    error = float(np.abs(np.asarray(logits) - reference).max() / np.abs(reference).max())
    return {
        "schema": schema, "parameters": parameters, "devices": DEVICES,
        "quantized_bytes": stored, "largest_float_tensor_bytes": largest,
        "rss_before_weights_mib": round(before, 1), "rss_after_weights_mib": round(after, 1),
        "peak_rss_mib": round(peak, 1),
        "peak_over_quantized": round(peak * 2 ** 20 / stored, 3),
        "quantize_s": round(quantize_s, 1),
        "up_kernel_sharding": str(kernel.qvalue.sharding.spec), "up_kernel_bytes_per_device": shard_bytes,
        "logits_sharding": str(logits.sharding.spec), "decode_ms": round(1e3 * float(np.median(times)), 1),
        "logits_finite": bool(np.isfinite(np.asarray(logits)).all()),
        "sharded_vs_one_device_max_relative_error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=os.path.join(ROOT, "out", "decoder_1b"))
    parser.add_argument("--schema", choices=("int8", "int4"), default="int8")
    parser.add_argument("--step", choices=("all", "write", "quantize"), default="all")
    args = parser.parse_args()
    if args.step == "write":
        return write(args.checkpoint)
    if args.step == "quantize":
        print(json.dumps(quantize(args.checkpoint, args.schema)))
        return
    from converters.sharded_checkpoint import INDEX

    if not os.path.isfile(os.path.join(args.checkpoint, INDEX)):
        subprocess.run([sys.executable, __file__, "--step", "write", "--checkpoint", args.checkpoint], check=True)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, __file__, "--step", "quantize", "--checkpoint", args.checkpoint,
                           "--schema", args.schema], env=env, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key, value in result.items():
        print(f"{key:45s} {value}")


if __name__ == "__main__":
    main()
