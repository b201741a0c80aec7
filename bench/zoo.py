"""What odmlq does today on models it was not designed for: the zoo of tests/zoo/models.py.

For each zoo model:

- ``float``: ``export_tflite(model, [], ..., verify=False)``, the reference for
  size and latency (and its SQNR against the JAX model, a sanity check).
- ``int8`` (``Rule('.*', weight_qtype='int8', act_qtype='int8')``), ``int16x8``
  (``act_qtype='int16'``) and ``dynamic`` (``act_dynamic=True``): exported with
  no option; if that fails, again with ``allow_float_ops=True`` (``+float``);
  if an export fails verification (``VerificationError``), once more with
  ``verify=False`` (``unverified``) to measure what the file would compute.
  Calibration: 8 batches of 8 (the export holds the last back to verify).
  Measured: .tflite bytes (and % of float), float ops
  (``summary.float_islands``), output SQNR against the float JAX model on 28
  held-out samples run one at a time in LiteRT, and LiteRT latency
  (1 thread, default XNNPACK delegate, batch 1, median of interleaved rounds
  with the float model) with the number of DELEGATE partitions.
- ``ptq w8``: ``odmlq.ptq`` with ``Rule('.*', weight_qtype='int8')``;
  ``ptq w8a8``: ``odmlq.plan`` + ``odmlq.calibrate`` (the same 8 batches) +
  ``odmlq.ptq``. SQNR against float at batch 1 (28 calls) and batch 7 (4 calls).

Every (model, schema) runs in its own subprocess, so that a crash (a LiteRT
abort or segfault) is recorded as ``crash (SIGABRT)`` and the table goes on.
Input and output names are fixed (``input_0``.., ``output_0``) to read the
signature; they change nothing else.

Run (transformers 4.x for the hf_* models, e.g. in a venv):
  python bench/zoo.py [--models a,b] [--schemas int8,dynamic] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXPORT_SCHEMAS = ("int8", "int16x8", "dynamic")
PTQ_SCHEMAS = ("ptq_w8", "ptq_w8a8")
CALIBRATION = (8, 8)  # batches, batch size
HELD_OUT = (4, 7)  # batches, batch size: 28 samples
CAL_SEED, HELD_SEED = 1, 2


# ---------------------------------------------------------------------------
# Worker side (one model, one schema, in a subprocess)


def _rules(schema: str):
    import odmlq

    return {
        "float": [],
        "int8": [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
        "int16x8": [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")],
        "dynamic": [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)],
        "ptq_w8": [odmlq.Rule(".*", weight_qtype="int8")],
        "ptq_w8a8": [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
    }[schema]


def sqnr_db(ref, out) -> float:
    import numpy as np

    ref = np.asarray(ref, np.float64).ravel()
    out = np.asarray(out, np.float64).ravel()
    noise = float(np.sum((ref - out) ** 2))
    signal_ = float(np.sum(ref ** 2))
    if not np.isfinite(noise):
        return float("-inf")
    return float("inf") if noise == 0 else 10.0 * np.log10(signal_ / noise)


def _error(e: BaseException) -> dict:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/odmlq/" in f.filename]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else ""
    return {"error_type": type(e).__name__, "message": str(e), "raised_at": where}


class _Tflite:
    """A LiteRT interpreter (1 thread) driven through its serving signature."""

    def __init__(self, tflite: bytes, n_inputs: int):
        import odmlq

        self.interpreter = odmlq.litert.interpreter(tflite, num_threads=1)
        runner = self.interpreter.get_signature_runner()
        inputs = runner.get_input_details()
        outputs = runner.get_output_details()
        self.inputs = [inputs[f"input_{i}"]["index"] for i in range(n_inputs)]
        self.output = outputs["output_0"]["index"]
        self.partitions = [o["op_name"] for o in self.interpreter._get_ops_details()].count("DELEGATE")

    def set(self, inputs) -> None:
        for index, x in zip(self.inputs, inputs):
            self.interpreter.set_tensor(index, x)

    def __call__(self, inputs):
        self.set(inputs)
        self.interpreter.invoke()
        return self.interpreter.get_tensor(self.output).copy()


def _per_sample(held):
    for batch in held:
        for i in range(batch[0].shape[0]):
            yield tuple(x[i:i + 1] for x in batch)


def _latency(interpreters: dict, sample, rounds: int) -> dict:
    """Median microseconds per invoke, interleaved rounds in rotating order."""
    for it in interpreters.values():
        it.set(sample)
        for _ in range(3):
            it.interpreter.invoke()
    # invokes per timing block: about 20 ms of the slowest model
    start = time.perf_counter()
    for it in interpreters.values():
        it.interpreter.invoke()
    per = max(time.perf_counter() - start, 1e-6)
    invokes = max(1, min(500, int(0.02 / per)))
    times = {k: [] for k in interpreters}
    keys = list(interpreters)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            it = interpreters[k].interpreter
            start = time.perf_counter()
            for _ in range(invokes):
                it.invoke()
            times[k].append((time.perf_counter() - start) / invokes * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def run_export(z, schema: str, *, allow_float_ops: bool, verify: bool, float_path: str | None,
               out_path: str, rounds: int) -> dict:
    import jax
    import numpy as np

    import odmlq

    cal = z.make_batches(*CALIBRATION, CAL_SEED)
    held = z.make_batches(*HELD_OUT, HELD_SEED)
    apply = jax.jit(z.apply)
    ref = [np.asarray(apply(*b)) for b in held]
    n = len(z.example_inputs)
    row: dict = {}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = odmlq.export_tflite(
                z.model, _rules(schema), cal, out_path, variables=z.variables,
                allow_float_ops=allow_float_ops, verify=verify,
                input_names=[f"input_{i}" for i in range(n)], output_names=["output_0"])
    except Exception as e:  # noqa: BLE001 - recorded, whatever it is
        row.update(outcome="error", export_s=time.perf_counter() - start, **_error(e))
        return row
    row.update(outcome="exported", export_s=time.perf_counter() - start, bytes=len(result.tflite),
               float_ops=len(result.summary.float_islands),
               float_op_names=sorted({o.name for o in result.summary.float_islands}),
               ops=dict(result.summary.op_histogram),
               warnings=[str(w.message)[:300] for w in caught
                         if "float ops" in str(w.message) or issubclass(w.category, UserWarning)][:5])
    if result.verification is not None:
        v = result.verification
        row.update(verify_sqnr_vs_simulate_db=v.output_sqnr_db,
                   verify_litert_vs_float_db=v.litert_float_sqnr_db,
                   verify_simulate_vs_float_db=v.simulate_float_sqnr_db)
    try:
        model = _Tflite(result.tflite, n)
        outs = [model(x) for x in _per_sample(held)]
        row["sqnr_db"] = sqnr_db(np.concatenate(ref), np.concatenate(outs))
        row["partitions"] = model.partitions
        interpreters = {"this": model}
        if float_path is not None and schema != "float":
            interpreters["float"] = _Tflite(Path(float_path).read_bytes(), n)
        latency = _latency(interpreters, next(_per_sample(held)), rounds)
        row["latency_us"] = latency["this"]
        if "float" in latency:
            row["float_latency_us"] = latency["float"]
            row["latency_vs_float"] = latency["this"] / latency["float"]
    except Exception as e:  # noqa: BLE001
        row.update(run_error=_error(e))
    return row


def run_ptq(z, schema: str) -> dict:
    import jax
    import numpy as np

    import odmlq

    cal = z.make_batches(*CALIBRATION, CAL_SEED)
    held = z.make_batches(*HELD_OUT, HELD_SEED)
    apply = jax.jit(z.apply)
    ref = [np.asarray(apply(*b)) for b in held]
    row: dict = {}
    stage = "plan"
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if schema == "ptq_w8":
                stage = "ptq"
                qmodel = odmlq.ptq(z.model, _rules(schema), z.variables, example_inputs=z.example_inputs)
            else:
                plan = odmlq.plan(z.model, _rules(schema), *z.example_inputs, variables=z.variables)
                stage = "calibrate"
                calibration = odmlq.calibrate(z.model, plan, cal, variables=z.variables)
                stage = "ptq"
                qmodel = odmlq.ptq(z.model, plan, z.variables, calibration)
            row["ptq_s"] = time.perf_counter() - start
            row["params_bytes"] = qmodel.nbytes
            stage = "run batch 1"
            outs1 = [np.asarray(qmodel(*x)) for x in _per_sample(held)]
            row["sqnr_b1_db"] = sqnr_db(np.concatenate(ref), np.concatenate(outs1))
            stage = "run batch 7"
            outs7 = [np.asarray(qmodel(*b)) for b in held]
            row["sqnr_b7_db"] = sqnr_db(np.concatenate(ref), np.concatenate(outs7))
            row["emulated_ops"] = sum(1 for v in qmodel.lowerings.values() if v.emulated)
            row["lowerings"] = len(qmodel.lowerings)
    except Exception as e:  # noqa: BLE001
        row.update(outcome="error", stage=stage, **_error(e))
        return row
    row["outcome"] = "ok"
    return row


def worker(spec: dict) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tests.zoo.models import ZOO

    z = ZOO[spec["model"]]()
    if spec["schema"] in PTQ_SCHEMAS:
        row = run_ptq(z, spec["schema"])
    else:
        row = run_export(z, spec["schema"], allow_float_ops=spec["allow_float_ops"], verify=spec["verify"],
                         float_path=spec.get("float_path"), out_path=spec["out_path"],
                         rounds=spec["rounds"])
    if spec["schema"] == "float":
        row["params"] = z.num_params
        row["family"] = z.family
        if row["outcome"] == "exported":
            # The float reference is exported unverified; does it pass odmlq's own check?
            import odmlq

            try:
                odmlq.export_tflite(z.model, [], z.make_batches(*CALIBRATION, CAL_SEED), variables=z.variables)
                row["float_verify"] = "passed"
            except Exception as e:  # noqa: BLE001
                error = _error(e)
                row["float_verify"] = f"{error['error_type']}: {error['message']}"
    Path(spec["result"]).write_text(json.dumps(row, default=float))


# ---------------------------------------------------------------------------
# Driver


def _spawn(spec: dict, timeout: float, python: str) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run([python, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as e:
        return {"outcome": "timeout", "message": f"no result after {timeout:.0f} s",
                "stderr_tail": (e.stderr or b"")[-2000:].decode(errors="replace")
                if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:]}
    wall = time.perf_counter() - start
    result = Path(spec["result"])
    if proc.returncode == 0 and result.exists():
        row = json.loads(result.read_text())
        row["wall_s"] = wall
        return row
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return {"outcome": "crash", "error_type": name, "message": f"worker killed by {name}",
                "stderr_tail": proc.stderr[-3000:], "wall_s": wall}
    return {"outcome": "error", "error_type": f"exit {proc.returncode}",
            "message": proc.stderr[-3000:], "wall_s": wall}


def _outcome(row: dict) -> str:
    if row["outcome"] in ("exported", "ok"):
        if row.get("float_verify") and row["float_verify"] != "passed":
            return f"exported (with verify=True: {row['float_verify'].split(':')[0]})"
        return row["outcome"]
    if row["outcome"] in ("crash", "timeout"):
        return f"{row['outcome']} ({row.get('error_type', '')})".replace(" ()", "")
    message = " ".join(row.get("message", "").split())
    return f"{row.get('error_type')}: {message[:200]}"


def source_digest() -> str:
    """sha256 of odmlq's sources as they are now (the tree may change between runs)."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((ROOT / "odmlq").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _short(message: str) -> str:
    """The message without the converter's MLIR call-stack notes and log lines."""
    keep = [line for line in message.splitlines()
            if line.strip() and not line.startswith((" ", "/", "WARNING:", "I0000", "E0000", "W0000"))]
    first = message.splitlines()[0] if message else ""
    text = " ".join(dict.fromkeys([first] + keep))
    if len(text) > 1500:  # the converter can list an MLIR call stack per op (70 kB seen)
        text = f"{text[:900]} [... {len(message):,} characters in all ...] {text[-500:]}"
    return text


def failures(rows: list[dict]) -> str:
    """Distinct failures (type + message), each with the (model, schema, variant) rows showing it."""
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        if r.get("float_verify", "passed") != "passed":
            kind, _, message = r["float_verify"].partition(": ")
            key = (f"{kind} (float export, verify=True)", _short(message), "")
            groups.setdefault(key, []).append(f"{r['model']} float")
        if r["outcome"] in ("exported", "ok"):
            continue
        key = (r.get("error_type"), _short(r.get("message", "")), r.get("raised_at", ""))
        groups.setdefault(key, []).append(f"{r['model']} {r['schema']} {r['variant']}".strip())
    out = []
    for i, ((kind, message, where), seen) in enumerate(groups.items(), 1):
        out.append(f"{i}. **{kind}** (raised at {where or '?'}) in: {', '.join(seen)}\n   > {message}")
    return "\n".join(out)


def _fmt(x, spec: str = ".1f", default: str = "-") -> str:
    if x is None:
        return default
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    return format(x, spec)


def main() -> None:
    from tests.zoo.models import ZOO

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--schemas", default=",".join(EXPORT_SCHEMAS + PTQ_SCHEMAS))
    parser.add_argument("--json", default=None, help="write every row (full error messages) here")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved latency rounds")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per (model, schema)")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    schemas = [s for s in args.schemas.split(",") if s]
    rows = []
    meta = {"odmlq_source_sha256_16": source_digest(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "calibration": CALIBRATION, "held_out": HELD_OUT, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="odmlq-zoo-") as tmp:
        for name in models:
            float_path = os.path.join(tmp, f"{name}.float.tflite")

            def attempt(schema, variant, **options):
                tag = f"{name}.{schema}.{variant}".replace("+", "_")
                spec = {"model": name, "schema": schema, "rounds": args.rounds,
                        "allow_float_ops": options.get("allow_float_ops", False),
                        "verify": options.get("verify", schema != "float"),
                        "float_path": float_path if os.path.exists(float_path) else None,
                        "out_path": float_path if schema == "float" else os.path.join(tmp, tag + ".tflite"),
                        "result": os.path.join(tmp, tag + ".json")}
                row = _spawn(spec, args.timeout, args.python)
                row.update(model=name, schema=schema, variant=variant)
                rows.append(row)
                print(f"{name:22s} {schema:9s} {variant:12s} {_outcome(row)[:150]}  "
                      f"({row.get('wall_s', 0):.0f} s)", file=sys.stderr, flush=True)
                return row

            float_row = attempt("float", "")
            for schema in schemas:
                if schema in PTQ_SCHEMAS:
                    attempt(schema, "")
                    continue
                row = attempt(schema, "default")
                if row["outcome"] != "exported":
                    row = attempt(schema, "+float", allow_float_ops=True)
                if row["outcome"] == "error" and row.get("error_type") == "VerificationError":
                    attempt(schema, "unverified", allow_float_ops=True, verify=False)
            del float_row
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["odmlq_source_sha256_16_at_end"] = source_digest()
    print(f"odmlq sources {meta['odmlq_source_sha256_16']} (at the end: "
          f"{meta['odmlq_source_sha256_16_at_end']}), {meta['started']} - {meta['finished']}\n")
    print(table(rows))
    print("\nDistinct failures:\n")
    print(failures(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=float))


def table(rows: list[dict]) -> str:
    floats = {r["model"]: r for r in rows if r["schema"] == "float"}
    out = ["| model | params | schema | variant | outcome | bytes (% of float) | float ops | SQNR dB | "
           "us / invoke (vs float) | XNNPACK partitions | export s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["schema"] in PTQ_SCHEMAS:
            continue
        f = floats.get(r["model"], {})
        size = "-"
        if "bytes" in r:
            size = f"{r['bytes']:,}"
            if f.get("bytes") and r["schema"] != "float":
                size += f" ({100 * r['bytes'] / f['bytes']:.0f}%)"
        lat = "-"
        if "latency_us" in r:
            lat = f"{r['latency_us']:.0f}"
            if "latency_vs_float" in r:
                lat += f" ({r['latency_vs_float']:.2f})"
        params = f"{f['params']:,}" if r["schema"] == "float" and "params" in f else ""
        out.append(f"| {r['model']} | {params} | {r['schema']} | {r['variant']} | {_outcome(r)} | {size} | "
                   f"{r.get('float_ops', '-')} | {_fmt(r.get('sqnr_db'))} | {lat} | "
                   f"{r.get('partitions', '-')} | {_fmt(r.get('export_s'), '.0f')} |")
    out += ["", "| model | schema | outcome | SQNR batch 1 dB | SQNR batch 7 dB | params bytes | emulated ops |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["schema"] not in PTQ_SCHEMAS:
            continue
        stage = f" (at {r['stage']})" if r.get("stage") else ""
        out.append(f"| {r['model']} | {r['schema']} | {_outcome(r)}{stage} | {_fmt(r.get('sqnr_b1_db'))} | "
                   f"{_fmt(r.get('sqnr_b7_db'))} | {_fmt(r.get('params_bytes'), ',')} | "
                   f"{r.get('emulated_ops', '-')} |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
